package server

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/torpor/torpor/snapshot"
	"github.com/torpor/torpor/snapshot/chunked"
)

// TestClassifyStoreErrors: a store whose S3 prefix is another store's answers
// 409 conflict (it answered 500 internal in a new-user trial); an unreachable
// S3 answers 503.
func TestClassifyStoreErrors(t *testing.T) {
	for _, c := range []struct {
		err    error
		status int
	}{
		{fmt.Errorf("delete snap-x: s3 delete manifests/snap-x.json: %w", chunked.ErrOwnedElsewhere), http.StatusConflict},
		{fmt.Errorf("s3 list: %w", snapshot.ErrUnavailable), http.StatusServiceUnavailable},
		{fmt.Errorf("boom"), http.StatusInternalServerError},
	} {
		if got, _ := classify(c.err); got != c.status {
			t.Errorf("classify(%v) = %d, want %d", c.err, got, c.status)
		}
	}
}
