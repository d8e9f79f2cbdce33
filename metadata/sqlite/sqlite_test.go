package sqlite

import (
	"path/filepath"
	"testing"

	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/metadata/storetest"
)

// TestConformance runs the metadata store suite on a database file per test.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) func() (metadata.Store, error) {
		path := filepath.Join(t.TempDir(), "torpor.db")
		return func() (metadata.Store, error) { return Open(path) }
	})
}
