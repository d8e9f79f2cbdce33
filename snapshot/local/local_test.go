package local

import (
	"testing"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) snapshot.Store {
		s, err := New(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}
