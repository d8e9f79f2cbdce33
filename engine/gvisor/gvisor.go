// Package gvisor is torpor's engine on gVisor (runsc), with the systrap platform.
//
// Every instance is one runsc sandbox with:
//   - the image's EROFS file as the read-only root, and the writable overlay in
//     sandbox memory (annotation dev.gvisor.spec.rootfs.overlay=memory), so the
//     writable layer travels inside the memory checkpoint;
//   - the guest agent as its first process, bind-mounted read-only at /.torpor;
//   - its own pair of network namespaces (package sandboxnet);
//   - a cgroup with the memory and CPU limits of its Spec, and its pids and
//     writable-layer limits (limits.go).
//
// Checkpoint and restore are runsc's (runsc restore; the checkpoint is the call
// runsc checkpoint makes, made directly on the sandbox's control socket, see
// control.go); a restore may go into a container created ahead of time for its
// shape (Config.PreparedContainers, prepared.go); pause and unpause are runsc
// pause and runsc resume (pause.go). The
// measured behaviour this package relies on is in docs/decisions/gvisor-engine.md:
// systrap because the KVM platform panics here; absolute image paths; restore
// needs the guest namespace's address and route put back first (so every restore
// gets a freshly made pair); the sandbox's stdio must not be pipes we wait on.
package gvisor

import (
	"bytes"
	"context"
	"debug/buildinfo"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/sandboxnet"
)

// Config configures the engine.
type Config struct {
	// Runsc is the path of the runsc binary.
	Runsc string
	// StateDir is a directory the engine owns: runsc's --root, bundles and logs live
	// below it. Two engines on one host must use different StateDirs.
	StateDir string
	// Platform is runsc's --platform (default "systrap").
	Platform string
	// ExtraFlags are appended to runsc's global flags (e.g. "--debug").
	ExtraFlags []string
	// Egress is the host's uplink for instances whose Spec asks for egress
	// (sandboxnet.Egress); nil = no instance gets a way out.
	Egress *sandboxnet.EgressConfig
	// PreparedContainers is how many containers the engine keeps created
	// ahead of time for restores, one per recently restored shape
	// (prepared.go); 0 = none, every restore creates its container.
	PreparedContainers int
	// SpareNetworks is how many pairs of network namespaces the engine
	// keeps made ahead of time for starts and restores (spares.go); 0 =
	// none, every instance's pair is made on its path.
	SpareNetworks int
	// BackgroundRestore passes --background to runsc restore: the restored
	// instance runs once its kernel state is loaded and its memory pages
	// load behind it, a page it touches first loaded first. Safe with any
	// snapshot.Store: `runsc restore` opens checkpoint.img, pages_meta.img
	// and pages.img by path and hands the descriptors to the sandbox before
	// it exits (runsc/sandbox/sandbox.go, setRestoreOptsForLocalCheckpointFiles),
	// so a store that removes the directory afterwards does not disturb the
	// loading, and no store writes into an opened snapshot's files
	// (snapshot.Store.Open); a checkpoint taken while pages still load waits
	// for them (pgalloc's SaveTo, AwaitLoadAll). Off by default in the
	// server (torpor serve --background-restore turns it on): with the
	// stock runsc's 128 page readers it is slower than without, and with 4
	// (`make runsc-readers`) the resume benchmark did not gain
	// (docs/decisions/patched-runsc.md).
	BackgroundRestore bool
}

// Engine implements engine.Engine with runsc.
type Engine struct {
	cfg     Config
	runsc   string
	version string
	// scope prefixes every host-wide name (network namespaces, cgroups) so two
	// engines with different StateDirs never collide.
	scope string
	// listMu keeps `runsc list` (read) apart from `runsc delete` and the
	// removal of its lock files (write): list finds a container's state file,
	// then locks the container, which creates <id>_sandbox:<id>.lock again if
	// a delete removed both in between (runsc/container/state_file.go), and
	// nothing ever removed that file (a new-user trial found 30 after a few
	// hundred hibernates).
	listMu sync.RWMutex
	// runscCheckpoints counts checkpoints made by starting `runsc checkpoint`
	// because the direct call could not be made (control.go).
	runscCheckpoints atomic.Int64
	// egress is the uplink (Config.Egress); nil = none.
	egress *sandboxnet.Egress
	// runscPauses counts pauses and unpauses made by starting runsc because
	// the direct call could not be made (pause.go).
	runscPauses atomic.Int64
	// prep is the prepared containers and the aliases of the instances
	// restored into them (prepared.go).
	prep preparedPool
	// spares is the spare network pairs (spares.go).
	spares sparePool
}

var (
	_ engine.Engine           = (*Engine)(nil)
	_ engine.ExitCheckpointer = (*Engine)(nil)
	_ engine.EgressProvider   = (*Engine)(nil)
	_ engine.Pauser           = (*Engine)(nil)
)

var idRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,59}$`)

// New checks the runsc binary and prepares StateDir. It returns an error when runsc
// is missing or not executable.
func New(cfg Config) (*Engine, error) {
	if cfg.Platform == "" {
		cfg.Platform = "systrap"
	}
	path, err := exec.LookPath(cfg.Runsc)
	if err != nil {
		return nil, fmt.Errorf("gvisor: runsc %q: %w (run `make setup`)", cfg.Runsc, err)
	}
	path, _ = filepath.Abs(path)
	dir, err := filepath.Abs(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	cfg.StateDir = dir
	for _, d := range []string{"root", "bundles", "logs"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			return nil, fmt.Errorf("gvisor: %w", err)
		}
	}
	e := &Engine{cfg: cfg, runsc: path, scope: Scope(dir)}
	if cfg.Egress != nil {
		if e.egress, err = sandboxnet.NewEgress(e.scope, *cfg.Egress); err != nil {
			return nil, fmt.Errorf("gvisor: %w", err)
		}
	}
	if err := e.initPrepared(); err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	e.initSpares() // named by the prepared pool's token
	e.thawAll()
	e.version = "runsc"
	if bi, err := buildinfo.ReadFile(path); err == nil && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		e.version = "runsc " + bi.Main.Version
	} else if bi != nil && bi.Path != "" {
		e.version = "runsc " + bi.Path
	}
	return e, nil
}

// Scope returns the short host-wide prefix derived from a state directory: "tp" and
// 6 hex digits of a hash of the path.
func Scope(stateDir string) string {
	var h uint32 = 2166136261
	for _, c := range []byte(stateDir) {
		h = (h ^ uint32(c)) * 16777619
	}
	return fmt.Sprintf("tp%06x", h&0xffffff)
}

// Name returns "gvisor".
func (e *Engine) Name() string { return "gvisor" }

// Version returns "runsc <module version>" read from the binary's build info.
func (e *Engine) Version() string { return e.version }

// HostScope returns the prefix of the engine's host-wide names (Scope of its
// state directory): cgroups torpor-<scope>/<instance>, network namespaces
// <scope>-<instance>-g and -h.
func (e *Engine) HostScope() string { return e.scope }

func (e *Engine) pair(id string) sandboxnet.Pair { return sandboxnet.For(e.scope, id) }

func (e *Engine) bundle(id string) string { return filepath.Join(e.cfg.StateDir, "bundles", id) }

// Start implements engine.Engine.
func (e *Engine) Start(ctx context.Context, spec engine.Spec) error {
	return e.launch(ctx, spec, "")
}

// Restore implements engine.Engine.
func (e *Engine) Restore(ctx context.Context, spec engine.Spec, dir string) error {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("gvisor: restore %s: image path %q is not absolute", spec.ID, dir)
	}
	return e.launch(ctx, spec, dir)
}

func (e *Engine) launch(ctx context.Context, spec engine.Spec, imageDir string) (err error) {
	if !idRE.MatchString(spec.ID) {
		return fmt.Errorf("gvisor: invalid instance id %q", spec.ID)
	}
	if !filepath.IsAbs(spec.RootFS) || !filepath.IsAbs(spec.GuestDir) {
		return fmt.Errorf("gvisor: %s: rootfs and guest dir must be absolute paths", spec.ID)
	}
	// A leftover with the same id (a crash mid-way) is removed first.
	if e.exists(spec.ID) {
		_ = e.Stop(ctx, spec.ID)
	}
	defer func() {
		if err != nil {
			_ = e.Stop(context.Background(), spec.ID)
		}
	}()
	if imageDir == "" {
		spec.RootFS, err = stableRootfs(spec.RootFS)
	} else if spec.RootFS, err = restoreRootfs(imageDir, spec.RootFS); err == nil {
		spec, err = restoredLimits(imageDir, spec)
	}
	if err != nil {
		return err
	}
	defer func() {
		if err == nil {
			e.launchedAs(spec)
		}
	}()
	if imageDir != "" {
		// The next restore of this shape finds its container prepared.
		defer func() {
			if err == nil {
				e.refill(spec)
			}
		}()
		if rid := e.claim(spec); rid != "" {
			return e.restorePrepared(ctx, spec, rid, imageDir)
		}
	}
	if err := e.writeBundle(ctx, spec); err != nil {
		return err
	}
	b := e.bundle(spec.ID)
	if imageDir == "" {
		_, err = e.run(ctx, "run", "--bundle", b, "--detach", spec.ID)
	} else {
		_, err = e.run(ctx, e.restoreArgs(imageDir, b, spec.ID)...)
	}
	if err != nil {
		what := "start"
		if imageDir != "" {
			what = "restore"
		}
		return fmt.Errorf("gvisor: %s %s: %w", what, spec.ID, err)
	}
	if err := e.applyCPU(spec); err != nil {
		return fmt.Errorf("gvisor: %s: cpu limit: %w", spec.ID, err)
	}
	return nil
}

// writeBundle makes what runsc needs to start instance spec.ID: its pair of
// network namespaces (with egress when spec asks for it), its bundle
// directory with config.json and the limits record.
func (e *Engine) writeBundle(ctx context.Context, spec engine.Spec) error {
	p := e.pair(spec.ID)
	if err := e.networkFor(ctx, spec.ID); err != nil {
		return err
	}
	if err := e.attachEgress(ctx, spec, p); err != nil {
		return err
	}
	b := e.bundle(spec.ID)
	if err := os.MkdirAll(filepath.Join(b, "rootfs"), 0o700); err != nil {
		return err
	}
	cfg, err := json.MarshalIndent(e.ociSpec(spec, p), "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(b, "config.json"), cfg, 0o600); err != nil {
		return err
	}
	return writeLimits(b, spec)
}

// attachEgress gives namespace pair p the egress rules spec asks for, if
// any and if the engine has an uplink.
func (e *Engine) attachEgress(ctx context.Context, spec engine.Spec, p sandboxnet.Pair) error {
	if spec.Egress == nil || e.egress == nil {
		return nil
	}
	r := sandboxnet.Rules{InternetAccess: spec.Egress.InternetAccess, AllowOut: spec.Egress.AllowOut, DenyOut: spec.Egress.DenyOut}
	if err := e.egress.Attach(ctx, p, r); err != nil {
		return fmt.Errorf("gvisor: %s: %w", spec.ID, err)
	}
	return nil
}

// restoreArgs is the runsc restore command of runsc container rid from
// imageDir with bundle b.
func (e *Engine) restoreArgs(imageDir, b, rid string) []string {
	args := []string{"restore", "--image-path", imageDir, "--bundle", b, "--detach"}
	if e.cfg.BackgroundRestore {
		args = append(args, "--background")
	}
	return append(args, rid)
}

// applyCPU writes the CPU quota of spec into the sandbox's cgroup (cgroup v1
// cpu controller, or cgroup v2 cpu.max), which runsc made from the spec's
// cgroupsPath.
func (e *Engine) applyCPU(spec engine.Spec) error {
	if spec.CPUs <= 0 {
		return nil
	}
	quota := int64(spec.CPUs * cpuPeriodUS)
	rel := e.cgroupPath(spec.ID)
	if st, err := os.Stat("/sys/fs/cgroup/cpu"); err == nil && st.IsDir() {
		dir := filepath.Join("/sys/fs/cgroup/cpu", rel)
		if err := os.WriteFile(filepath.Join(dir, "cpu.cfs_period_us"), []byte(fmt.Sprint(cpuPeriodUS)), 0); err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dir, "cpu.cfs_quota_us"), []byte(fmt.Sprint(quota)), 0)
	}
	return os.WriteFile(filepath.Join("/sys/fs/cgroup", rel, "cpu.max"), []byte(fmt.Sprintf("%d %d", quota, cpuPeriodUS)), 0)
}

// listTimeout bounds one `runsc list` (List). It takes ~10–20 ms here; a
// sandbox frozen after its checkpoint holds it until the hibernate's commit
// ends (up to ~12 s with S3 hung, the store's own bounds).
const listTimeout = 30 * time.Second

// cgroupPath is the instance's cgroup, relative to each controller's root.
func (e *Engine) cgroupPath(id string) string { return "/torpor-" + e.scope + "/" + id }

// Checkpoint implements engine.Engine.
func (e *Engine) Checkpoint(ctx context.Context, id, dir string, leaveRunning bool) error {
	if err := e.checkpoint(ctx, e.rid(id), dir, leaveRunning); err != nil {
		return err
	}
	e.expect(id)
	if !leaveRunning {
		return e.Stop(ctx, id)
	}
	return nil
}

// CheckpointExit implements engine.ExitCheckpointer: runsc checkpoint without
// --leave-running, after which gVisor kills the sentry's kernel
// (pkg/sentry/state.SaveOpts.Save: "Kill the sandbox") and the sandbox process
// exits on its own; Stop removes the rest.
//
// The instance is frozen (freeze) once the image is complete: its teardown,
// unmapping and freeing the sandbox's memory (~21 ms of CPU at 64 MiB, against
// the commit's ~20 ms, perf sampling of bench.BenchmarkStore, 2026-12-01),
// would otherwise run beside the snapshot's commit on a two-core host. Stop
// thaws it. A freeze that fails only leaves the teardown running.
func (e *Engine) CheckpointExit(ctx context.Context, id, dir string) error {
	rid := e.rid(id)
	if err := e.checkpoint(ctx, rid, dir, false); err != nil {
		return err
	}
	_ = e.freeze(rid, true)
	e.expect(id)
	return nil
}

// freezer returns the freezer file of instance id's cgroup and the values that
// freeze and thaw it: cgroup v1 freezer.state FROZEN or THAWED, cgroup v2
// cgroup.freeze 1 or 0 (Linux Documentation/admin-guide/cgroup-v1/freezer-subsystem.rst,
// cgroup-v2.rst). id "*" gives the glob of all the engine's instances.
func (e *Engine) freezer(id string) (file, frozen, thawed string) {
	if st, err := os.Stat("/sys/fs/cgroup/freezer"); err == nil && st.IsDir() {
		return filepath.Join("/sys/fs/cgroup/freezer", e.cgroupPath(id), "freezer.state"), "FROZEN", "THAWED"
	}
	return filepath.Join("/sys/fs/cgroup", e.cgroupPath(id), "cgroup.freeze"), "1", "0"
}

// freeze freezes (frozen) or thaws every process of instance id through its
// cgroup's freezer. It returns once the state is written, not when every task
// has stopped; a task already exiting stops only when it is gone. A missing
// cgroup (the instance is gone) is not an error.
func (e *Engine) freeze(id string, frozen bool) error {
	file, fr, th := e.freezer(id)
	val := th
	if frozen {
		val = fr
	}
	if err := os.WriteFile(file, []byte(val), 0); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// thawAll thaws every instance cgroup of the engine's scope. Only a crash
// between a CheckpointExit and the Stop that follows it leaves an instance
// frozen, and runsc blocks on a frozen sandbox (list, delete): the next server
// start hung in `runsc list` until thawed by hand (found by a new-user trial,
// kill -9 of the server in that window). New calls it; the thawed sandbox
// finishes the exit gVisor began after its checkpoint.
func (e *Engine) thawAll() {
	glob, _, _ := e.freezer("*")
	files, _ := filepath.Glob(glob)
	for _, f := range files {
		if id := filepath.Base(filepath.Dir(f)); idRE.MatchString(id) {
			_ = e.freeze(id, false)
		}
	}
}

func (e *Engine) checkpoint(ctx context.Context, id, dir string, leaveRunning bool) error {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("gvisor: checkpoint %s: image path %q is not absolute", id, dir)
	}
	if err := e.recordRootfs(id, dir); err != nil {
		return err
	}
	if err := e.recordLimits(id, dir); err != nil {
		return err
	}
	err := e.checkpointDirect(ctx, id, dir, leaveRunning)
	if err == nil {
		return nil
	}
	if !errors.Is(err, errNoControlSocket) {
		return fmt.Errorf("gvisor: checkpoint %s: %w", id, err)
	}
	e.runscCheckpoints.Add(1)
	args := []string{"checkpoint", "--image-path", dir}
	if leaveRunning {
		args = append(args, "--leave-running")
	}
	args = append(args, id)
	if _, err := e.run(ctx, args...); err != nil {
		return fmt.Errorf("gvisor: checkpoint %s: %w", id, err)
	}
	return nil
}

// Stop implements engine.Engine: thaw (freeze), runsc delete --force, then wait
// for the sandbox process to be gone, then remove the namespaces and the bundle;
// for an instance restored into a prepared container, its alias last.
func (e *Engine) Stop(ctx context.Context, id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("gvisor: invalid instance id %q", id)
	}
	rid := e.rid(id)
	e.forgetLaunched(id)
	if err := e.stop(ctx, rid); err != nil {
		return err
	}
	if rid != id {
		e.dropAlias(id)
	}
	return nil
}

// stop removes runsc container id and everything made for it (Stop).
func (e *Engine) stop(ctx context.Context, id string) error {
	e.unready(id)
	var errs []error
	// Thawed first: a frozen sandbox (CheckpointExit) neither answers runsc
	// delete nor dies of SIGKILL under the cgroup v1 freezer.
	if err := e.freeze(id, false); err != nil {
		errs = append(errs, fmt.Errorf("thaw: %w", err))
	}
	if e.hasRunscState(id) || len(e.lockFiles(id)) > 0 {
		st, _ := e.state(ctx, id) // pid to wait for; 0 if runsc cannot say
		e.listMu.Lock()
		if _, err := e.run(ctx, "delete", "--force", id); err != nil && !isNotExist(err) {
			errs = append(errs, fmt.Errorf("delete: %w", err))
		}
		for _, f := range e.lockFiles(id) { // left by a delete that failed, or from before listMu
			if err := os.Remove(f); err != nil && !os.IsNotExist(err) {
				errs = append(errs, err)
			}
		}
		e.listMu.Unlock()
		if st.Pid > 0 {
			if err := waitGone(ctx, st.Pid, 5*time.Second); err != nil {
				_ = syscall.Kill(st.Pid, syscall.SIGKILL)
			}
		}
	}
	// runsc does not always kill what it started (seen after a --leave-running
	// checkpoint: `runsc state` fails and `delete --force` leaves the sandbox
	// process running). Whatever still runs with this instance's bundle under
	// this engine's root is killed.
	for _, pid := range e.processes()[id] {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		if err := waitGone(ctx, pid, 5*time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	if err := sandboxnet.Delete(ctx, e.pair(id)); err != nil {
		errs = append(errs, err)
	}
	// runsc delete removes the cgroup, but a delete cut short (a server
	// killed while it ran) leaves it behind with no state to delete again.
	if err := removeCgroups(e.cgroupDirs(id)); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(e.bundle(id)); err != nil {
		errs = append(errs, err)
	}
	os.Remove(filepath.Join(e.cfg.StateDir, "root", ".status-"+id+".tmp")) // a crashed writeStatus's
	if len(errs) > 0 {
		return fmt.Errorf("gvisor: stop %s: %w", id, errors.Join(errs...))
	}
	return nil
}

// cgroupDirs returns instance id's cgroup directories: one per cgroup v1
// controller (/sys/fs/cgroup/<controller>/torpor-<scope>/<id>) or the cgroup
// v2 one (/sys/fs/cgroup/torpor-<scope>/<id>); id "*" gives every instance's.
func (e *Engine) cgroupDirs(id string) []string {
	var dirs []string
	for _, pat := range []string{"/sys/fs/cgroup/*" + e.cgroupPath(id), "/sys/fs/cgroup" + e.cgroupPath(id)} {
		m, _ := filepath.Glob(pat)
		for _, d := range m {
			if dirExists(d) {
				dirs = append(dirs, d)
			}
		}
	}
	return dirs
}

// removeCgroups removes the cgroup directories dirs, children first (rmdir:
// a cgroup's files go with it). Errors: rmdir's, for a cgroup that still has
// tasks (EBUSY); one already gone is not an error.
func removeCgroups(dirs []string) error {
	var errs []error
	for _, d := range dirs {
		var sub []string
		_ = filepath.WalkDir(d, func(p string, de fs.DirEntry, err error) error {
			if err == nil && de.IsDir() {
				sub = append(sub, p)
			}
			return nil
		})
		for i := len(sub) - 1; i >= 0; i-- {
			if err := syscall.Rmdir(sub[i]); err != nil && !errors.Is(err, syscall.ENOENT) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", sub[i], err))
			}
		}
	}
	return errors.Join(errs...)
}

// lockFiles returns runsc's lock files for instance id under the engine's root.
func (e *Engine) lockFiles(id string) []string {
	m, _ := filepath.Glob(filepath.Join(e.cfg.StateDir, "root", id+"_sandbox:*.lock"))
	return m
}

// hasRunscState reports whether runsc keeps state for id under the engine's root.
func (e *Engine) hasRunscState(id string) bool {
	m, _ := filepath.Glob(filepath.Join(e.cfg.StateDir, "root", id+"_sandbox:*.state"))
	return len(m) > 0
}

// exists reports whether anything of instance id is on the host: runsc state, a
// bundle, a network namespace or a cgroup.
func (e *Engine) exists(id string) bool {
	if e.hasRunscState(id) {
		return true
	}
	if _, err := os.Stat(e.bundle(id)); err == nil {
		return true
	}
	p := e.pair(id)
	for _, n := range []string{p.Guest, p.Host} {
		if _, err := os.Stat("/run/netns/" + n); err == nil {
			return true
		}
	}
	return len(e.cgroupDirs(id)) > 0
}

// Dial implements engine.Engine.
func (e *Engine) Dial(ctx context.Context, id string, port int) (net.Conn, error) {
	c, err := e.pair(e.rid(id)).Dial(ctx, port)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("gvisor: dial %s:%d: %w", id, port, engine.ErrNotRunning)
		}
		return nil, fmt.Errorf("gvisor: dial %s:%d: %w", id, port, err)
	}
	return c, nil
}

// Resolver implements engine.EgressProvider.
func (e *Engine) Resolver() (netip.Addr, error) {
	if e.egress == nil {
		return netip.Addr{}, errors.New("no uplink is configured on this server (torpor serve --uplink-netns or --uplink)")
	}
	return e.egress.Resolver(), nil
}

// HostNetns returns the name (under /run/netns) of the instance's host-side network
// namespace; a server started there is reachable from the guest at
// sandboxnet.HostIP.
func (e *Engine) HostNetns(id string) sandboxnet.Pair { return e.pair(e.rid(id)) }

type runscState struct {
	ID     string `json:"id"`
	Pid    int    `json:"pid"`
	Status string `json:"status"`
}

func (e *Engine) state(ctx context.Context, id string) (runscState, error) {
	out, err := e.run(ctx, "state", id)
	if err != nil {
		return runscState{}, err
	}
	var st runscState
	if err := json.Unmarshal(out, &st); err != nil {
		return runscState{}, fmt.Errorf("runsc state %s: %w", id, err)
	}
	return st, nil
}

// List implements engine.Engine: runsc's containers under this engine's root, plus
// instances of which only a bundle or a network namespace is left.
func (e *Engine) List(ctx context.Context) ([]engine.Info, error) {
	// runsc list asks each running sandbox for its state and waits as long as
	// one does not answer (a frozen one: CheckpointExit until its Stop): an
	// error after listTimeout rather than a caller stuck for good.
	ctx, cancel := context.WithTimeout(ctx, listTimeout)
	defer cancel()
	e.listMu.RLock()
	out, err := e.run(ctx, "list", "--format", "json")
	e.listMu.RUnlock()
	if err != nil {
		return nil, fmt.Errorf("gvisor: list: %w", err)
	}
	var sts []runscState
	if len(bytes.TrimSpace(out)) > 0 && !bytes.Equal(bytes.TrimSpace(out), []byte("null")) {
		if err := json.Unmarshal(out, &sts); err != nil {
			return nil, fmt.Errorf("gvisor: list: %w", err)
		}
	}
	seen := map[string]engine.Info{}
	for _, s := range sts {
		live := (s.Status == statusRunning || s.Status == statusPaused) && alive(s.Pid)
		seen[s.ID] = engine.Info{ID: s.ID, Pid: s.Pid, Running: live, Paused: live && s.Status == statusPaused}
	}
	if ents, err := os.ReadDir(filepath.Join(e.cfg.StateDir, "bundles")); err == nil {
		for _, d := range ents {
			if _, ok := seen[d.Name()]; !ok {
				seen[d.Name()] = engine.Info{ID: d.Name()}
			}
		}
	}
	// A lock file without a state file: the remains of a deleted instance (or
	// one runsc is creating this moment; Stop is not called on those).
	locks, _ := filepath.Glob(filepath.Join(e.cfg.StateDir, "root", "*_sandbox:*.lock"))
	for _, l := range locks {
		id, _, _ := strings.Cut(filepath.Base(l), "_sandbox:")
		if _, ok := seen[id]; !ok && idRE.MatchString(id) {
			seen[id] = engine.Info{ID: id}
		}
	}
	for id, pids := range e.processes() {
		if i, ok := seen[id]; !ok || !i.Running {
			seen[id] = engine.Info{ID: id, Pid: pids[0], Running: true}
		}
	}
	// A cgroup without anything else: a runsc delete cut short.
	for _, d := range e.cgroupDirs("*") {
		if id := filepath.Base(d); idRE.MatchString(id) {
			if _, ok := seen[id]; !ok {
				seen[id] = engine.Info{ID: id}
			}
		}
	}
	names, _ := sandboxnet.List(e.scope)
	for _, n := range names {
		id := strings.TrimPrefix(n, e.scope+"-")
		id = strings.TrimSuffix(strings.TrimSuffix(id, "-g"), "-h")
		if _, ok := seen[id]; !ok && idRE.MatchString(id) && !e.isSpare(id) {
			seen[id] = engine.Info{ID: id}
		}
	}
	// Instances restored into prepared containers by the caller's ids; an
	// alias whose container is gone is listed (stopped) so Stop removes it.
	res := make([]engine.Info, 0, len(seen))
	named := map[string]bool{}
	for _, i := range seen {
		i.ID = e.instanceOf(i.ID)
		named[i.ID] = true
		res = append(res, i)
	}
	for _, id := range e.aliases() {
		if !named[id] {
			res = append(res, engine.Info{ID: id})
		}
	}
	sort.Slice(res, func(a, b int) bool { return res[a].ID < res[b].ID })
	return res, nil
}

func (e *Engine) globalFlags() []string {
	f := []string{
		"--root", filepath.Join(e.cfg.StateDir, "root"),
		"--platform", e.cfg.Platform,
		"--network", "sandbox",
		// Honour set-user-ID executables inside the sandbox, as Linux and runc do, so
		// that a non-root user can use sudo and su (E2B's user "user" can). It
		// grants nothing outside the sandbox; a sandbox keeps the setting it started
		// with across checkpoints.
		"--allow-suid",
	}
	return append(f, e.cfg.ExtraFlags...)
}

// run runs runsc with the engine's global flags. The sandbox inherits stdio from
// `runsc run/restore --detach` and `runsc create`, so stdin and stdout are /dev/null and stderr is a
// temporary regular file (never a pipe: the sandbox would hold its write end and a
// reader would never see EOF).
func (e *Engine) run(ctx context.Context, args ...string) ([]byte, error) {
	errf, err := os.CreateTemp(filepath.Join(e.cfg.StateDir, "logs"), "runsc-stderr-*")
	if err != nil {
		return nil, err
	}
	defer os.Remove(errf.Name())
	defer errf.Close()
	cmd := exec.CommandContext(ctx, e.runsc, append(e.globalFlags(), args...)...)
	var out bytes.Buffer
	// runsc create leaves the sandbox process running like --detach does.
	detach := args[0] == "create"
	for _, a := range args {
		if a == "--detach" {
			detach = true
		}
	}
	if detach {
		cmd.Stdout = nil // /dev/null
	} else {
		cmd.Stdout = &out
	}
	cmd.Stderr = errf
	// A runsc killed by ctx may leave children holding its stdout: Wait gives
	// up on them after WaitDelay instead of outliving ctx.
	cmd.WaitDelay = 2 * time.Second
	// Its own session: a runsc command outlives a crashed server, so a checkpoint
	// under way completes and the next server commits it (manager.Reconcile).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Run()
	if err != nil {
		msg, _ := os.ReadFile(errf.Name())
		return out.Bytes(), fmt.Errorf("runsc %s: %v: %s", args[0], err, lastLines(string(msg), 5))
	}
	return out.Bytes(), nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

func isNotExist(err error) bool {
	return err != nil && (strings.Contains(err.Error(), "does not exist") || strings.Contains(err.Error(), "not found"))
}

// processes returns, by instance id, the host pids of runsc processes (sandbox,
// gofer) started under this engine's root: their command lines carry
// --root=<root> and --bundle=<bundles>/<id>.
func (e *Engine) processes() map[string][]int {
	root := "--root=" + filepath.Join(e.cfg.StateDir, "root")
	bundlePrefix := "--bundle=" + filepath.Join(e.cfg.StateDir, "bundles") + "/"
	out := map[string][]int{}
	ents, _ := os.ReadDir("/proc")
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + d.Name() + "/cmdline")
		if err != nil || !bytes.Contains(b, []byte(root)) {
			continue
		}
		var hasRoot bool
		var id string
		for _, a := range strings.Split(string(b), "\x00") {
			hasRoot = hasRoot || a == root
			if strings.HasPrefix(a, bundlePrefix) {
				id = strings.TrimPrefix(a, bundlePrefix)
			}
		}
		if hasRoot && id != "" && alive(pid) {
			out[id] = append(out[id], pid)
		}
	}
	return out
}

// Close releases what runsc keeps mounted in the engine's root (its null-netns
// file), removes the spare network pairs, the engine's empty parent cgroups
// (tests made thousands a day otherwise) and the uplink's table (Config.Egress). Call it only when no
// instance of this engine runs any more (tests).
func (e *Engine) Close() error {
	_ = e.discardSpares(context.Background())
	if e.egress != nil {
		_ = e.egress.Close()
	}
	p := filepath.Join(e.cfg.StateDir, "root", "null-netns")
	if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
		return fmt.Errorf("gvisor: unmount %s: %w", p, err)
	}
	// The parent cgroups of this engine's instances (one per controller),
	// empty once no instance runs; rmdir leaves a non-empty one alone.
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*/torpor-" + e.scope)
	if d := "/sys/fs/cgroup/torpor-" + e.scope; dirExists(d) {
		dirs = append(dirs, d)
	}
	for _, d := range dirs {
		_ = syscall.Rmdir(d)
	}
	return nil
}

func dirExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// alive reports whether pid exists and is not a zombie. Sandbox processes are
// reparented to the host's init when runsc exits, and a zombie waits there until
// init reaps it: it runs nothing and holds no resources but its pid.
func alive(pid int) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// Field 3, after the parenthesised command name, is the state.
	if i := bytes.LastIndexByte(b, ')'); i >= 0 && i+2 < len(b) && b[i+2] == 'Z' {
		return false
	}
	return true
}

func waitGone(ctx context.Context, pid int, d time.Duration) error {
	deadline := time.Now().Add(d)
	for alive(pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("sandbox process %d still alive after %s", pid, d)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}
