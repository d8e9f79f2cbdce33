package manager

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"

	"github.com/torpor/torpor/sandbox"
)

func TestNoSpace(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"ENOSPC in a path error", fmt.Errorf("commit: %w", &os.PathError{Op: "write", Path: "/d/chunks/x", Err: syscall.ENOSPC}), true},
		{"EDQUOT", fmt.Errorf("stage: %w", syscall.EDQUOT), true},
		{"runsc's text", errors.New("checkpoint: runsc: writing pages.img: write /d/x: no space left on device"), true},
		{"SQLite's SQLITE_FULL", errors.New("metadata: update sandbox sbx-1: database or disk is full (13)"), true},
		{"another error", fmt.Errorf("commit: %w", syscall.EIO), false},
	} {
		if got := NoSpace(c.err); got != c.want {
			t.Errorf("%s: NoSpace(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}

func TestDiskFullKind(t *testing.T) {
	err := diskFull("hibernate", "sbx-1", fmt.Errorf("checkpoint: %w", syscall.ENOSPC))
	if sandbox.KindOf(err) != sandbox.InsufficientStorage || !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("diskFull of ENOSPC: %v (kind %v); want insufficient storage wrapping ENOSPC", err, sandbox.KindOf(err))
	}
	if again := diskFull("hibernate", "sbx-1", err); again != err {
		t.Errorf("diskFull wrapped an insufficient-storage error again: %v", again)
	}
	other := errors.New("checkpoint: runsc exited 1")
	if got := diskFull("hibernate", "sbx-1", other); got != other {
		t.Errorf("diskFull changed an error that is not about space: %v", got)
	}
}
