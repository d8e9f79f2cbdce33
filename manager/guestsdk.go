package manager

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"

	pysdk "github.com/torpor/torpor/sdk/python"
)

// GuestPythonDir is where the Python SDK is inside a sandbox: the guest
// directory is mounted read-only at /.torpor, and the default image's
// /usr/lib/python3/dist-packages/torpor.pth names this directory, so
// `import torpor.resume` works in every sandbox of the default image.
const GuestPythonDir = "/.torpor/python"

// guestDigest folds the embedded Python SDK into the guest directory's version
// (agentDigest is the agent binary's sha256): a new SDK gets a new directory,
// and snapshots keep the one they were taken with.
func guestDigest(agentDigest string) string {
	py := pysdk.Digest()
	sum := sha256.Sum256([]byte("agent " + agentDigest + "\npython " + hex.EncodeToString(py[:]) + "\n"))
	return hex.EncodeToString(sum[:])
}

// writeGuestSDK writes the Python SDK into dir/python (dir is a guest
// directory being installed; the agent binary is written after it, so a
// directory with the agent is complete).
func writeGuestSDK(dir string) error {
	names, files, err := pysdk.Package()
	if err != nil {
		return fmt.Errorf("python sdk: %w", err)
	}
	for _, n := range names {
		dst := filepath.Join(dir, "python", filepath.FromSlash(n))
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		tmp := dst + ".tmp"
		if err := os.WriteFile(tmp, files[n], 0o444); err != nil {
			return err
		}
		if err := os.Rename(tmp, dst); err != nil {
			return err
		}
	}
	return nil
}
