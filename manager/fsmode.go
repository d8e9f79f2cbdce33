package manager

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/torpor/torpor/guest/proto"
	"github.com/torpor/torpor/internal/atomicfile"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
	"github.com/torpor/torpor/snapshot"
)

// Hibernation mode "filesystem": only the writable layer is kept.
//
// Hibernate: the guest agent runs, inside the sandbox,
//
//	cd / && find . -xdev -mindepth 1 <prune volumes> -newerct @<image time> -print0 |
//	    tar --null --no-recursion -T - -cpf /tmp/.torpor-fs.tar
//
// i.e. every file, directory, symlink and device node of the root filesystem
// whose ctime is newer than the image (ctime changes on every write, chmod or
// rename and cannot be set back by the user, so this is the overlay's content:
// created, copied-up and changed files). Other mounts are skipped (-xdev): /tmp
// (a tmpfs), /proc, /dev, volumes. The archive is read through the agent's file
// API into the snapshot as fs.tar, and the instance is stopped: memory and
// processes are dropped. Not kept: deletions of files that are in the image
// (overlay whiteouts; the file is back after a resume), /tmp, and anything a
// process writes after the capture started.
//
// Resume: a fresh instance boots from the image (with the current guest agent),
// the archive is unpacked over the root (tar -xp), and the sandbox's on_resume
// command is started detached (its output goes to /tmp/torpor-bg-<pid>.log, as
// for a background exec). This is the resume contract's rebuild-from-log path
// (docs/resume-contract.md): processes start again and rebuild their state from
// files.

const fsLayerFile = "fs.tar"
const fsTarInSandbox = "/tmp/.torpor-fs.tar"

// isFilesystemSnapshot reports whether snapshot id holds a writable layer only.
func (m *Manager) isFilesystemSnapshot(ctx context.Context, id string) bool {
	if id == "" {
		return false
	}
	man, err := m.cfg.Store.Manifest(ctx, id)
	return err == nil && isFilesystemManifest(man)
}

// isFilesystemManifest reports whether man is a writable layer's snapshot.
func isFilesystemManifest(man snapshot.Manifest) bool {
	for _, f := range man.Files {
		if f.Name == fsLayerFile {
			return true
		}
	}
	return false
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func (m *Manager) hibernateFilesystemLocked(ctx context.Context, s *metadata.Sandbox, async bool) error {
	start := time.Now()
	m.accrue(ctx, s, start)
	c := m.liveClient(s.ID)
	if c == nil {
		return sandboxConflict(s.ID, "sandbox %s: no guest agent connection", s.ID)
	}
	img, _, err := m.cfg.Images.Get(ctx, s.ImageDigest)
	if err != nil {
		return fmt.Errorf("hibernate %s: image %s: %w", s.ID, s.ImageDigest, err)
	}
	snapID := newID("snap-")
	s.PendingSnapshot = snapID
	s.State = sandbox.StateHibernating
	s.StateChangedAt = time.Now().UTC()
	if err := m.cfg.DB.UpdateSandbox(ctx, s); err != nil {
		return err
	}
	undo := func(cause error) error {
		_ = m.cfg.Store.Abort(ctx, snapID)
		s.PendingSnapshot = ""
		_ = m.setState(ctx, s, sandbox.StateRunning)
		return cause
	}
	dir, err := m.cfg.Store.Stage(ctx, snapID)
	if err != nil {
		return undo(err)
	}
	cctx, cancel := context.WithTimeout(ctx, m.lcfg().FilesystemTimeout)
	defer cancel()
	// Mount points (and volumes) are pruned: -xdev skips their contents but would
	// still list the mount point itself, with the mounted filesystem's times.
	prune := "-path ./tmp -o -path ./proc -o -path ./sys -o -path ./dev -o -path ./.torpor"
	for _, v := range s.Volumes {
		prune += " -o -path " + shellQuote("."+v.Path)
	}
	// The image's files are older than the image record; 1 s of slack for
	// whole-second ctimes.
	since := img.CreatedAt.Unix() - 1
	script := fmt.Sprintf(`cd / && rm -f %[1]s && find . -xdev -mindepth 1 \( %[2]s \) -prune -o -newerct @%[3]d -print0 2>/dev/null | tar --null --no-recursion -T - -cpf %[1]s`,
		fsTarInSandbox, prune, since)
	_, stderr, code, err := c.Run(cctx, proto.ExecRequest{Cmd: []string{"sh", "-c", script}})
	// tar exits 1 when a file changed while it was read (a process still writes):
	// the archive is complete, with that file as it was at some point.
	if err == nil && code > 1 {
		err = fmt.Errorf("exit %d: %s", code, strings.TrimSpace(string(stderr)))
	}
	if err != nil {
		return undo(fmt.Errorf("hibernate %s: capture writable layer: %w", s.ID, err))
	}
	rc, _, err := c.ReadFile(cctx, fsTarInSandbox)
	if err != nil {
		return undo(fmt.Errorf("hibernate %s: read writable layer: %w", s.ID, err))
	}
	err = atomicfile.WriteFrom(filepath.Join(dir, fsLayerFile), rc, 0o600)
	rc.Close()
	if err != nil {
		return undo(fmt.Errorf("hibernate %s: store writable layer: %w", s.ID, err))
	}
	// The layer is captured: drop the processes and the memory.
	m.dropLive(s.ID)
	eng := m.eng(s)
	if err := eng.Stop(ctx, s.Instance); err != nil {
		m.log.Warn("hibernate (filesystem): stop instance", "sandbox", s.ID, "instance", s.Instance, "err", err)
	}
	now := time.Now().UTC()
	man := snapshot.Manifest{
		ID: snapID, SandboxID: s.ID, Parent: s.SnapshotID,
		Engine: eng.Name(), EngineVersion: "filesystem layer",
		Spec: snapshot.SandboxSpec{Image: s.Image, ImageDigest: s.ImageDigest, MemoryMiB: s.MemoryMiB,
			CPUs: s.CPUs, Env: s.Env, GuestDigest: s.GuestDigest},
		CreatedAt:   now,
		HibernateMS: time.Since(start).Milliseconds(),
	}
	man, err = m.commitSnapshot(ctx, snapID, man, async)
	if err != nil {
		_ = m.cfg.Store.Abort(ctx, snapID)
		s.PendingSnapshot = ""
		m.fail(ctx, s, fmt.Errorf("hibernate %s: commit: %w", s.ID, err))
		return err
	}
	_, err = m.recordSnapshot(ctx, s, man, start, now, false)
	return err
}

// resumeFilesystemLocked resumes a sandbox whose snapshot is a writable layer:
// fresh boot, unpack, on_resume. On failure the sandbox stays hibernated.
func (m *Manager) resumeFilesystemLocked(ctx context.Context, s *metadata.Sandbox) error {
	start := time.Now()
	if err := m.setState(ctx, s, sandbox.StateResuming); err != nil {
		return err
	}
	back := func(cause error) error {
		s.Instance = ""
		s.Error = ""
		_ = m.setState(ctx, s, sandbox.StateHibernated)
		s.Error = cause.Error()
		return cause
	}
	dir, man, done, err := m.openSnapshot(ctx, s.SnapshotID, "resume", s.ID)
	if err != nil {
		return back(err)
	}
	defer done() // after the writable layer's upload below
	e, err := m.restoreEngine(s.SnapshotID, man)
	if err != nil {
		return back(err)
	}
	rootfs, err := m.snapshotImage(ctx, s.Image, man.Spec.ImageDigest)
	if err != nil {
		return back(fmt.Errorf("resume %s: image %s: %w", s.ID, man.Spec.ImageDigest, err))
	}
	gen, err := m.cfg.DB.NextGeneration(ctx)
	if err != nil {
		return back(err)
	}
	s.Seq++
	s.Instance = instanceID(s.ID, s.Seq)
	s.GuestDigest = m.guestDigest // a fresh boot runs the current agent
	if err := m.cfg.DB.UpdateSandbox(ctx, s); err != nil {
		return back(err)
	}
	stop := func(cause error) error {
		m.dropLive(s.ID)
		_ = m.eng(s).Stop(ctx, s.Instance)
		return back(fmt.Errorf("resume %s: %w", s.ID, cause))
	}
	if err := m.on(e, s).Start(ctx, m.spec(s, rootfs)); err != nil {
		return stop(err)
	}
	launched := time.Now()
	if err := m.waitAgent(ctx, s); err != nil {
		return stop(err)
	}
	c := m.liveClient(s.ID)
	cctx, cancel := context.WithTimeout(ctx, m.lcfg().FilesystemTimeout)
	defer cancel()
	f, err := os.Open(filepath.Join(dir, fsLayerFile))
	if err != nil {
		return stop(err)
	}
	st, _ := f.Stat()
	err = c.WriteFile(cctx, fsTarInSandbox, f, st.Size())
	f.Close()
	if err != nil {
		return stop(fmt.Errorf("upload writable layer: %w", err))
	}
	_, stderr, code, err := c.Run(cctx, proto.ExecRequest{Cmd: []string{"sh", "-c",
		"tar -C / -xpf " + fsTarInSandbox + " && rm -f " + fsTarInSandbox}})
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d: %s", code, strings.TrimSpace(string(stderr)))
	}
	if err != nil {
		return stop(fmt.Errorf("unpack writable layer: %w", err))
	}
	// The resume contract runs after the unpack (the layer holds the old
	// /run/torpor files) and before on_resume.
	s.LastResume = m.runContract(ctx, s, gen, m.restoresClone(ctx, s), false, s.SnapshotID, launched)
	if len(s.OnResume) > 0 {
		if _, err := c.Start(cctx, proto.ExecRequest{Cmd: s.OnResume, Background: true}); err != nil {
			// The sandbox is back with its files; a broken on_resume is the user's to fix.
			m.log.Warn("resume (filesystem): on_resume did not start", "sandbox", s.ID, "cmd", s.OnResume, "err", err)
		}
	}
	now := time.Now().UTC()
	s.Generation = gen
	s.LastResumeAt = &now
	s.ResumeMS = time.Since(start).Milliseconds()
	if err := m.setState(ctx, s, sandbox.StateRunning); err != nil {
		return err
	}
	m.log.Info("resumed (filesystem)", "sandbox", s.ID, "total_ms", s.ResumeMS)
	m.cfg.Metrics.resume.Observe(time.Since(start).Seconds())
	return nil
}
