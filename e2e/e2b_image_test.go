package e2e

import (
	"io"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/server/servertest"
)

// TestE2BBaseImage: a sandbox created through the REST API from the image
// e2b-base (E2B's template "base", docs/e2b.md) has E2B's account — uid 1000,
// home /home/user owned by it, bash, passwordless sudo — and the tools E2B
// programs expect, also after a resume. The image comes from the host's build
// cache (`make setup`).
func TestE2BBaseImage(t *testing.T) {
	srv := start(t, servertest.Options{})
	t0 := time.Now()
	img, err := srv.Images.EnsureE2BBase(ctxFor(t, 20*time.Minute), io.Discard)
	if err != nil {
		t.Fatalf("e2b-base image: %v", err)
	}
	t.Logf("image %s (%s) ready in %v", img.Name, img.Source, time.Since(t0).Round(100*time.Millisecond))
	c := srv.Client
	sb := create(t, c, apiv1.CreateSandboxRequest{Image: image.E2BBaseName})
	if sb.Image != image.E2BBaseName || sb.ImageDigest != img.Digest {
		t.Errorf("sandbox image %q %s, want %q %s", sb.Image, sb.ImageDigest, image.E2BBaseName, img.Digest)
	}

	for _, c2 := range []struct{ script, want string }{
		{`id user`, "uid=1000(user) gid=1000(user) groups=1000(user),27(sudo)\n"},
		{`stat -c '%U:%G %u:%g %a' /home/user`, "user:user 1000:1000 755\n"},
		// A login shell, as envd runs every command, gets Debian's PATH for the
		// user and for root, from bash and from sh ...
		{`runuser -u user -- env -i HOME=/home/user bash -l -c 'echo $PATH' && runuser -u user -- env -i HOME=/home/user sh -l -c 'echo $PATH'`,
			"/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games\n/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games\n"},
		{`env -i HOME=/root bash -l -c 'echo $PATH'`, "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"},
		// ... without forking id or mesg (each process costs milliseconds
		// under gVisor, on every command E2B's SDK runs).
		{`{ runuser -u user -- env -i HOME=/home/user bash -l -x -c true; env -i HOME=/root bash -l -x -c true; } 2>&1 | grep -c -e 'id -u' -e mesg || true`, "0\n"},
		// C.UTF-8, the agent's default LANG, comes from a locale archive.
		{`localedef --list-archive && LANG=C.UTF-8 python3 -c 'import locale; print(locale.setlocale(locale.LC_ALL, ""))'`, "C.utf8\nC.UTF-8\n"},
		// su with a login shell, as E2B's envd starts commands (bash -l).
		{`su - user -c 'id -un; echo "$HOME"; pwd; echo "$SHELL"'`, "user\n/home/user\n/home/user\n/bin/bash\n"},
		// sudo -n fails where a password would be asked.
		{`runuser -u user -- sudo -n id -u`, "0\n"},
		{`runuser -u user -- sh -c 'cd && touch made /usr/local/bin/made && stat -c %U made /usr/local/bin/made'`, "user\nuser\n"},
		{`node -e 'console.log(6 * 7)' && python3 -c 'print(6 * 7)'`, "42\n42\n"},
		// POSIX shared memory, as Linux mounts /dev/shm: every user may write
		// there (Python's multiprocessing needs it for its locks).
		{`stat -c %a /dev/shm && runuser -u user -- sh -c 'touch /dev/shm/x && stat -c %U /dev/shm/x' &&
			runuser -u user -- python3 -c 'import multiprocessing as m; l = m.Lock(); print(l.acquire())'`, "1777\nuser\nTrue\n"},
	} {
		if got := sh(t, c, sb.ID, c2.script); got != c2.want {
			t.Errorf("%s:\n got %q\nwant %q", c2.script, got, c2.want)
		}
	}
	for _, v := range []struct{ cmd, want string }{
		{"node --version", `^v\d+\.\d+\.\d+\n$`},
		{"npm --version", `^\d+\.\d+\.\d+\n$`},
		{"git --version", `^git version \d+\.`},
		{"curl --version", `^curl \d+\.\d+`},
		{"python3 --version", `^Python 3\.\d+\.\d+\n$`},
		{"pip3 --version", `^pip \d+`},
		{"bash --version", `^GNU bash, version \d+`},
	} {
		// As the user, the way E2B runs a command.
		got := sh(t, c, sb.ID, `su - user -c '`+v.cmd+`'`)
		if !regexp.MustCompile(v.want).MatchString(got) {
			t.Errorf("%s: %q, want match %s", v.cmd, got, v.want)
		} else {
			t.Logf("%s: %s", v.cmd, strings.SplitN(got, "\n", 2)[0])
		}
	}

	// A resumed sandbox keeps honouring sudo (gVisor keeps --allow-suid in its
	// kernel state) and the user's files.
	hibernate(t, c, sb.ID)
	if _, err := c.Resume(ctxFor(t, 2*time.Minute), sb.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}
	if got := sh(t, c, sb.ID, `runuser -u user -- sudo -n id -u && stat -c %U /home/user/made`); got != "0\nuser\n" {
		t.Errorf("after resume: sudo and the user's file: %q", got)
	}
	if got := sh(t, c, sb.ID, `stat -c %a /dev/shm && runuser -u user -- sh -c 'touch /dev/shm/y && ls /dev/shm'`); got != "1777\nx\ny\n" {
		t.Errorf("after resume: /dev/shm as the user: %q, want mode 1777 with x kept and y made", got)
	}
}
