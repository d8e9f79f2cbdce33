package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/engine/gvisor"
	"github.com/torpor/torpor/workload"
)

// crashSlots is how many sandboxes the harness keeps at most; crashWorkers
// how many goroutines drive them.
const (
	crashSlots   = 4
	crashWorkers = 3
)

// crashSandbox is what the harness knows of one sandbox: only what the API
// acknowledged counts as known.
type crashSandbox struct {
	id    string
	busy  bool              // an operation on it is in flight
	files map[string]string // path -> sha256 of each acknowledged write
	// hibernated: its last acknowledged operation was a hibernate and nothing
	// was tried on it since, so the API must say hibernated.
	hibernated bool
	// paused: likewise for an acknowledged pause: the API must say paused
	// (a kill of the server alone leaves the paused instance to reattach).
	paused bool
	// pid and count of its workload, when known (count is its last answer;
	// only the checks ask it, so the next answer is count+1).
	pid   int
	count int64
	known bool // pid and count are known
	// gone: a delete was tried and did not answer (the sandbox may or may
	// not exist).
	gone bool
}

// crashCounts are the harness's figures.
type crashCounts struct {
	ops, acked, failed map[string]int
	kills, violations  int
	killsPaused        int            // kills that found an acknowledged pause the last call on some sandbox
	verified           map[string]int // what the checks found kept: files, counters, hibernates resumed, states
	errs               []string       // the first errors of cut or refused operations
	unacked            int            // sandboxes the API lists that no answer named (cut creates, forks)
}

type crashHarness struct {
	t     *testing.T
	p     *serveProc
	c     *client.Client
	scope string

	mu    sync.Mutex // guards slots, counts
	slots []*crashSandbox
	n     crashCounts
	seq   int
	// listed is how many sandboxes the last check found.
	listed int

	// epoch is the context of the operations between two kills: cancelled
	// at each kill, so that what was in flight ends at once (its outcome is
	// for the checks to find).
	epoch  context.Context
	cancel context.CancelFunc
	// killing is set from just before a kill until the restart: no new
	// operation starts (it would only be refused).
	killing atomic.Bool

	// phase is read-locked by each operation and locked by the restart and
	// its checks, so that no operation runs while the harness checks.
	phase sync.RWMutex

	// killedPrepared holds the runsc ids of the unclaimed prepared
	// containers (engine/gvisor/prepared.go; the harness's servers keep the
	// default two) on the host right after the last kill: the next server's
	// reconcile must stop them.
	killedPrepared map[string]bool
}

// violation records a broken promise.
func (h *crashHarness) violation(format string, args ...any) {
	h.t.Helper()
	h.mu.Lock()
	h.n.violations++
	h.mu.Unlock()
	h.t.Errorf("VIOLATION: "+format, args...)
}

// verified counts one kept promise of kind what.
func (h *crashHarness) verified(what string) {
	h.mu.Lock()
	h.n.verified[what]++
	h.mu.Unlock()
}

// TestCrashHarness drives create, exec, file writes, hibernate, pause, resume
// (of a paused sandbox: an unpause), fork and delete on up to 4 sandboxes from
// 3 goroutines while it kills `torpor serve` with SIGKILL at random moments
// (0.2–3 s apart), restarts it on the same data directory and checks after
// every restart: each sandbox's state is true (running ones answer an exec,
// paused ones keep their runsc processes, hibernated ones have none), nothing
// is orphaned (runsc processes, network namespaces and cgroups of this data
// directory's scope that no running or paused sandbox owns, snapshot staging
// directories), each acknowledged hibernate or pause is still hibernated or
// paused and resumes with its workload continuing (same pid, counter +1),
// and every acknowledged file write reads
// back with its hash. Operations in flight at a kill may have either outcome;
// the API must then say which. TORPOR_CRASH_KILLS sets the number of kills
// (default 5; `make soak`: 50).
func TestCrashHarness(t *testing.T) {
	kills := 5
	if v := os.Getenv("TORPOR_CRASH_KILLS"); v != "" {
		k, err := strconv.Atoi(v)
		if err != nil || k < 1 {
			t.Fatalf("TORPOR_CRASH_KILLS=%q: want a positive number", v)
		}
		kills = k
	}
	t0 := time.Now()
	p := &serveProc{t: t, bin: buildTorpor(t), addr: freeAddr(t), log: filepath.Join(t.TempDir(), "serve.log")}
	if err := os.Remove(filepath.Join(dataDir, "store")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	p.start()
	c := p.client()
	c.Retries = 0 // a cut answer stays cut: the harness checks what the API then says
	h := &crashHarness{t: t, p: p, c: c, scope: gvisor.Scope(filepath.Join(dataDir, "gvisor")),
		n: crashCounts{ops: map[string]int{}, acked: map[string]int{}, failed: map[string]int{}, verified: map[string]int{}}}
	for range crashSlots {
		h.slots = append(h.slots, &crashSandbox{})
	}
	h.epoch, h.cancel = context.WithCancel(context.Background())
	defer h.cleanup()

	stop := startWorkers(crashWorkers, func(rng *mrand.Rand) {
		h.phase.RLock()
		stepped := h.step(rng)
		h.phase.RUnlock()
		if !stepped {
			time.Sleep(50 * time.Millisecond)
		}
	})
	for k := 1; k <= kills && !t.Failed(); k++ {
		time.Sleep(200*time.Millisecond + time.Duration(mrand.Int64N(int64(2800*time.Millisecond))))
		h.killing.Store(true)
		if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		p.waitKilled()
		h.killedPrepared = h.unclaimedPrepared()
		h.cancel()
		h.phase.Lock() // the operations in flight end
		h.mu.Lock()
		h.n.kills++
		for _, s := range h.slots {
			if s.paused {
				h.n.killsPaused++
				break
			}
		}
		h.mu.Unlock()
		tr := time.Now()
		p.start()
		h.check(fmt.Sprintf("after kill %d", k))
		h.epoch, h.cancel = context.WithCancel(context.Background())
		h.killing.Store(false)
		t.Logf("kill %d: restart and checks of %d sandboxes took %v; the killed server left %d unclaimed prepared containers, %d instances ran in prepared ones",
			k, h.listed, time.Since(tr).Round(time.Millisecond), len(h.killedPrepared), len(aliases()))
		h.phase.Unlock()
	}
	tw := time.Now()
	stop()
	t.Logf("the last operations ended in %v", time.Since(tw).Round(time.Millisecond))
	h.phase.Lock()
	h.check("at the end")
	h.phase.Unlock()
	h.mu.Lock()
	defer h.mu.Unlock()
	t.Logf("crash harness: %d kills (%d with a sandbox paused), %d operations (%d acknowledged, %d cut or refused), %d sandboxes no answer named, %d violations, in %v",
		h.n.kills, h.n.killsPaused, sum(h.n.ops), sum(h.n.acked), sum(h.n.failed), h.n.unacked, h.n.violations, time.Since(t0).Round(time.Second))
	t.Logf("operations: %v; acknowledged: %v; checked and kept: %v", h.n.ops, h.n.acked, h.n.verified)
	t.Logf("first errors of cut or refused operations:\n%s", strings.Join(h.n.errs, "\n"))
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// step picks and runs one operation; false when none can start now.
func (h *crashHarness) step(rng *mrand.Rand) bool {
	if h.killing.Load() {
		return false // killed: the restart comes
	}
	h.mu.Lock()
	var free, empty, live []*crashSandbox
	for _, s := range h.slots {
		switch {
		case s.busy:
		case s.id == "":
			empty = append(empty, s)
			free = append(free, s)
		default:
			live = append(live, s)
			free = append(free, s)
		}
	}
	if len(free) == 0 {
		h.mu.Unlock()
		return false
	}
	s := free[rng.IntN(len(free))]
	op := "create"
	var dst *crashSandbox
	if s.id != "" {
		ops := []string{"exec", "exec", "write", "write", "write", "hibernate", "hibernate", "pause", "pause", "resume", "fork", "fork", "delete"}
		op = ops[rng.IntN(len(ops))]
		if op == "fork" {
			if len(empty) == 0 {
				op = "exec"
			} else {
				dst = empty[rng.IntN(len(empty))]
				dst.busy = true
			}
		}
	}
	s.busy = true
	h.n.ops[op]++
	h.seq++
	seq := h.seq
	h.mu.Unlock()

	t0 := time.Now()
	err := h.run(op, s, dst, seq)
	ok := err == nil
	if d := time.Since(t0); d > 10*time.Second {
		h.t.Logf("slow operation: %s on %s took %v (err %v)", op, s.id, d.Round(time.Millisecond), err)
	}

	h.mu.Lock()
	s.busy = false
	if dst != nil {
		dst.busy = false
	}
	if ok {
		h.n.acked[op]++
	} else {
		h.n.failed[op]++
		if len(h.n.errs) < 12 {
			h.n.errs = append(h.n.errs, fmt.Sprintf("%s after %v: %v", op, time.Since(t0).Round(time.Millisecond), err))
		}
	}
	h.mu.Unlock()
	return true
}

// run runs op on s and returns its error (dst: the empty slot a fork's clone goes to) and updates
// what the harness knows by what was acknowledged. Slots are the caller's
// (busy) while it runs.
func (h *crashHarness) run(op string, s, dst *crashSandbox, seq int) error {
	ctx, cancel := context.WithTimeout(h.epoch, 2*time.Minute)
	defer cancel()
	c := h.c
	if op != "create" {
		s.hibernated, s.paused = false, false // tried: either outcome, until acknowledged
	}
	switch op {
	case "create":
		never := 0
		sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{MemoryMiB: 256, IdleTimeoutS: &never})
		if err != nil {
			return err
		}
		h.mu.Lock()
		*s = crashSandbox{id: sb.ID, busy: true, files: map[string]string{}}
		h.mu.Unlock()
		if err := workload.Start(ctx, c, sb.ID, 4); err != nil {
			return err
		}
		st, err := workload.Get(ctx, c, sb.ID, "/count")
		if err != nil {
			return err
		}
		s.pid, s.count, s.known = st.Pid, st.Count, true
		return nil
	case "exec":
		out, _, code, err := c.ExecCollect(ctx, s.id, apiv1.ExecRequest{Cmd: []string{"echo", "ok"}})
		if err != nil {
			return err
		}
		if code != 0 || string(out) != "ok\n" {
			h.violation("exec in %s acknowledged with exit %d, output %q", s.id, code, out)
		}
		return nil
	case "write":
		data := make([]byte, 1+mrand.IntN(64<<10))
		rand.Read(data)
		path := fmt.Sprintf("/root/crash-%d", seq)
		if err := c.WriteFile(ctx, s.id, path, bytes.NewReader(data)); err != nil {
			return err
		}
		s.files[path] = sha(data)
		return nil
	case "hibernate":
		sb, err := c.Hibernate(ctx, s.id)
		if err != nil {
			return err
		}
		if sb.State != apiv1.StateHibernated {
			h.violation("hibernate of %s acknowledged with state %s", s.id, sb.State)
		}
		s.hibernated = true
		return nil
	case "pause":
		r, err := c.Pause(ctx, s.id)
		if err != nil {
			return err
		}
		if r.State != apiv1.StatePaused || r.Snapshot == nil {
			h.violation("pause of %s acknowledged with state %s, snapshot %v; want paused with its snapshot", s.id, r.State, r.Snapshot)
			return nil
		}
		s.paused = true
		return nil
	case "resume":
		// Of a paused sandbox: an unpause (same instance, same generation).
		_, err := c.Resume(ctx, s.id)
		return err
	case "fork":
		clones, err := c.Fork(ctx, s.id, 1)
		if err != nil {
			return err
		}
		if len(clones) != 1 {
			h.violation("fork of %s acknowledged with %d clones, want 1", s.id, len(clones))
			return nil
		}
		files := map[string]string{}
		for k, v := range s.files {
			files[k] = v
		}
		h.mu.Lock()
		*dst = crashSandbox{id: clones[0].ID, busy: true, files: files, pid: s.pid, count: s.count, known: s.known}
		h.mu.Unlock()
		return nil
	case "delete":
		err := c.DeleteSandbox(ctx, s.id)
		if err != nil {
			s.gone = true
			return err
		}
		h.mu.Lock()
		*s = crashSandbox{busy: true}
		h.mu.Unlock()
		return nil
	}
	panic(op)
}

// settled lists the sandboxes once none is in a transitional state (an
// interrupted hibernate finishes after the restart), waiting up to 2 min.
func (h *crashHarness) settled(ctx context.Context, when string) []apiv1.Sandbox {
	t := h.t
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		all, err := h.c.ListSandboxes(ctx)
		if err != nil {
			t.Fatalf("%s: list: %v", when, err)
		}
		var moving []string
		for _, sb := range all {
			switch sb.State {
			case apiv1.StateRunning, apiv1.StateHibernated, apiv1.StateError, apiv1.StatePaused:
			default:
				moving = append(moving, sb.ID+" "+string(sb.State))
			}
		}
		if len(moving) == 0 {
			return all
		}
		if time.Now().After(deadline) {
			h.violation("%s: sandboxes still in transitional states 2 min after the restart with no call in flight: %v", when, moving)
			return all
		}
		time.Sleep(200 * time.Millisecond)
	}
}

var instanceRE = regexp.MustCompile(`\b([a-z0-9_-]+)-([0-9]{8})\b`)

// preparedRE matches the runsc id of a prepared container.
var preparedRE = regexp.MustCompile(`^prep-[0-9a-f]{12}-[0-9]{6}$`)

// unclaimedPrefix marks, in the names runscInstances and hostName return,
// a prepared container no instance was restored into.
const unclaimedPrefix = "unclaimed:"

// aliases maps the runsc id of each prepared container an instance was
// restored into to that instance's id (DATA_DIR/gvisor/aliases).
func aliases() map[string]string { return aliasesIn(dataDir) }

// aliasesIn is aliases for the server of data directory dir.
func aliasesIn(data string) map[string]string {
	dir := filepath.Join(data, "gvisor", "aliases")
	ents, _ := os.ReadDir(dir)
	out := map[string]string{}
	for _, e := range ents {
		if b, err := os.ReadFile(filepath.Join(dir, e.Name())); err == nil {
			out[strings.TrimSpace(string(b))] = e.Name()
		}
	}
	return out
}

// hostName returns the instance a host name (a runsc id, the base of a
// cgroup or a network namespace) belongs to: an instance id as it is, a
// prepared container's runsc id through its alias, unclaimedPrefix and the
// runsc id for a prepared container no instance was restored into, "" for
// anything else.
func hostName(name string, al map[string]string) string {
	if m := instanceRE.FindString(name); m != "" && m == name {
		return name
	}
	if preparedRE.MatchString(name) {
		if inst, ok := al[name]; ok {
			return inst
		}
		return unclaimedPrefix + name
	}
	return ""
}

// unclaimedPrepared returns the runsc ids of the prepared containers on the
// host that no instance was restored into (processes, cgroups, namespaces).
func (h *crashHarness) unclaimedPrepared() map[string]bool {
	out := map[string]bool{}
	for inst := range h.runscInstances() {
		if rid, ok := strings.CutPrefix(inst, unclaimedPrefix); ok {
			out[rid] = true
		}
	}
	al := aliases()
	for _, n := range h.netnsNames() {
		if rid, ok := strings.CutPrefix(hostName(n, al), unclaimedPrefix); ok {
			out[rid] = true
		}
	}
	for _, cg := range h.cgroups() {
		if rid, ok := strings.CutPrefix(hostName(filepath.Base(cg), al), unclaimedPrefix); ok {
			out[rid] = true
		}
	}
	return out
}

// netnsNames returns the network namespaces of this scope, without the
// scope and the -g/-h suffix (one entry per namespace).
func (h *crashHarness) netnsNames() []string {
	ents, _ := os.ReadDir("/run/netns")
	var out []string
	for _, e := range ents {
		if name, ok := strings.CutPrefix(e.Name(), h.scope+"-"); ok {
			out = append(out, strings.TrimSuffix(strings.TrimSuffix(name, "-g"), "-h"))
		}
	}
	return out
}

// cgroups returns the cgroup directories of this scope.
func (h *crashHarness) cgroups() []string {
	var out []string
	for _, pat := range []string{"/sys/fs/cgroup/*/torpor-" + h.scope + "/*", "/sys/fs/cgroup/torpor-" + h.scope + "/*"} {
		m, _ := filepath.Glob(pat)
		for _, cg := range m {
			if st, err := os.Stat(cg); err == nil && st.IsDir() {
				out = append(out, cg)
			}
		}
	}
	return out
}

// runscInstances returns, by instance (hostName), the live runsc processes
// on this data directory's runsc root.
func (h *crashHarness) runscInstances() map[string][]string {
	root := filepath.Join(dataDir, "gvisor", "root")
	al := aliases()
	out := map[string][]string{}
	for _, p := range hostProcs(root) {
		if !strings.Contains(p, "runsc") {
			continue
		}
		id := ""
		for _, f := range strings.Fields(p) {
			if n := hostName(filepath.Base(f), al); n != "" {
				id = n
			}
		}
		out[id] = append(out[id], p)
	}
	return out
}

// sandboxOf returns the sandbox id of an instance name "<id>-<8 digits>".
func sandboxOf(instance string) string {
	if i := strings.LastIndexByte(instance, '-'); i > 0 {
		return instance[:i]
	}
	return instance
}

// hostProblems compares the API's list byID with the host: runsc
// processes, network namespaces and cgroups of this scope that no running or
// paused sandbox owns, staging directories, running sandboxes without a
// process or whose exec fails, hibernated or error ones with processes.
func (h *crashHarness) hostProblems(ctx context.Context, byID map[string]apiv1.Sandbox) []string {
	var out []string
	procs := h.runscInstances()
	al := aliases()
	live := map[string]bool{}  // sandboxes with runsc processes
	ready := map[string]bool{} // the running server's unclaimed prepared containers
	prepared := func(name, what string) bool {
		rid, ok := strings.CutPrefix(name, unclaimedPrefix)
		if !ok {
			return false
		}
		if h.killedPrepared[rid] {
			out = append(out, fmt.Sprintf("%s of prepared container %s, which the killed server left and its successor did not stop", what, rid))
		} else {
			ready[rid] = true
		}
		return true
	}
	for inst, ps := range procs {
		if prepared(inst, "runsc processes") {
			continue
		}
		sid := sandboxOf(inst)
		live[sid] = true
		sb, ok := byID[sid]
		if !ok || (sb.State != apiv1.StateRunning && sb.State != apiv1.StatePaused) {
			out = append(out, fmt.Sprintf("runsc processes of instance %q, whose sandbox the API says is %q (listed %v):\n%s", inst, sb.State, ok, strings.Join(ps, "\n")))
		}
	}
	var spares []string
	for _, name := range h.netnsNames() {
		if strings.HasPrefix(name, "spare-") {
			spares = append(spares, name) // the engine's spare pairs (engine/gvisor/spares.go)
			continue
		}
		inst := hostName(name, al)
		if inst == "" {
			inst = name
		}
		if prepared(inst, "network namespace "+name) {
			continue
		}
		if sb := byID[sandboxOf(inst)]; sb.State != apiv1.StateRunning && sb.State != apiv1.StatePaused {
			out = append(out, fmt.Sprintf("network namespace %s-%s of a sandbox the API says is %q", h.scope, name, sb.State))
		}
	}
	// The harness's servers keep no spares (--spare-networks 0, the
	// default); any is a leak.
	if len(spares) > 0 {
		out = append(out, fmt.Sprintf("%d spare network namespaces of servers that keep none: %v", len(spares), spares))
	}
	for _, cg := range h.cgroups() {
		inst := hostName(filepath.Base(cg), al)
		if inst == "" {
			inst = filepath.Base(cg)
		}
		if prepared(inst, "cgroup "+cg) {
			continue
		}
		if sb := byID[sandboxOf(inst)]; sb.State != apiv1.StateRunning && sb.State != apiv1.StatePaused {
			out = append(out, fmt.Sprintf("cgroup %s of a sandbox the API says is %q", cg, sb.State))
		}
	}
	// The server keeps at most its --prepared-containers (the default, 2),
	// ready or being made.
	if len(ready) > 2 {
		out = append(out, fmt.Sprintf("%d unclaimed prepared containers, more than the server keeps: %v", len(ready), ready))
	}
	for _, dir := range []string{filepath.Join(dataDir, "chunks", "staging"), filepath.Join(dataDir, "snapshots", ".staging")} {
		if st, _ := os.ReadDir(dir); len(st) > 0 {
			var names []string
			for _, e := range st {
				names = append(names, e.Name())
			}
			out = append(out, fmt.Sprintf("staging directories left in %s: %v", dir, names))
		}
	}
	for _, sb := range byID {
		h.verified("states")
		switch sb.State {
		case apiv1.StateRunning:
			if !live[sb.ID] {
				out = append(out, fmt.Sprintf("the API says %s is running; no runsc process runs it", sb.ID))
				continue
			}
			o, _, code, err := h.c.ExecCollect(ctx, sb.ID, apiv1.ExecRequest{Cmd: []string{"echo", "ok"}})
			if err != nil || code != 0 || string(o) != "ok\n" {
				out = append(out, fmt.Sprintf("the API says %s is running; exec gives %q exit %d err %v", sb.ID, o, code, err))
			}
		case apiv1.StatePaused:
			// Only the server was killed: the paused instance is still there.
			if !live[sb.ID] {
				out = append(out, fmt.Sprintf("the API says %s is paused; no runsc process holds it", sb.ID))
			}
		case apiv1.StateHibernated, apiv1.StateError:
			if live[sb.ID] {
				out = append(out, fmt.Sprintf("the API says %s is %s; its runsc processes run", sb.ID, sb.State))
			}
		}
	}
	return out
}

// check runs the checks of a restart (no operation is in flight).
func (h *crashHarness) check(when string) {
	t := h.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c := h.c
	all := h.settled(ctx, when)
	h.listed = len(all)
	byID := map[string]apiv1.Sandbox{}
	for _, sb := range all {
		byID[sb.ID] = sb
	}

	// True states and orphans, against the host. A hibernate answers before
	// its exited instance is removed: the host gets 15 s to catch up.
	var problems []string
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(250 * time.Millisecond) {
		problems = h.hostProblems(ctx, byID)
		if len(problems) == 0 || time.Now().After(deadline) {
			break
		}
	}
	for _, p := range problems {
		h.violation("%s: %s", when, p)
	}

	// What was acknowledged, against the API.
	known := map[string]bool{}
	for _, s := range h.slots {
		if s.id == "" {
			continue
		}
		known[s.id] = true
		sb, listed := byID[s.id]
		if s.gone {
			// A delete without an answer: either outcome, then delete again.
			if listed {
				if err := c.DeleteSandbox(ctx, s.id); err != nil {
					h.violation("%s: delete %s (%s) again after a cut delete: %v", when, s.id, sb.State, err)
				}
			}
			*s = crashSandbox{}
			continue
		}
		if !listed {
			h.violation("%s: sandbox %s was never deleted but the API does not list it", when, s.id)
			*s = crashSandbox{}
			continue
		}
		if s.hibernated && sb.State != apiv1.StateHibernated {
			h.violation("%s: hibernate of %s was acknowledged (nothing tried since); the API says %s", when, s.id, sb.State)
		}
		if s.paused && sb.State != apiv1.StatePaused {
			h.violation("%s: pause of %s was acknowledged (nothing tried since); the API says %s", when, s.id, sb.State)
		}
		if sb.State == apiv1.StateError {
			// No promise covers a sandbox the API created for us and then
			// lost with only the server killed: that is a violation, then it
			// is deleted.
			h.violation("%s: sandbox %s is in state error: %s", when, s.id, sb.Error)
			c.DeleteSandbox(ctx, s.id)
			*s = crashSandbox{}
			continue
		}
		// The workload continues: this resumes a hibernated one (every
		// acknowledged hibernate resumes).
		st, err := workload.Get(ctx, c, s.id, "/count")
		switch {
		case err != nil && s.known:
			h.violation("%s: workload of %s (was %s) does not answer: %v", when, s.id, sb.State, err)
		case err == nil && s.known && (st.Pid != s.pid || st.Count != s.count+1):
			h.violation("%s: workload of %s (was %s): pid %d count %d, want pid %d count %d", when, s.id, sb.State, st.Pid, st.Count, s.pid, s.count+1)
		case err == nil && s.known:
			h.verified("workload counters")
			switch sb.State {
			case apiv1.StateHibernated:
				h.verified("hibernated resumed")
			case apiv1.StatePaused:
				h.verified("paused resumed")
			}
		}
		if err == nil {
			s.pid, s.count, s.known = st.Pid, st.Count, true
		} else {
			s.known = false
			if sb.State == apiv1.StateHibernated {
				if _, err := c.Resume(ctx, s.id); err != nil {
					h.violation("%s: resume of hibernated %s: %v", when, s.id, err)
				} else {
					h.verified("hibernated resumed")
				}
			}
		}
		s.hibernated, s.paused = false, false
		paths := make([]string, 0, len(s.files))
		for p := range s.files {
			paths = append(paths, p)
		}
		sort.Strings(paths)
		for _, p := range paths {
			rc, err := c.ReadFile(ctx, s.id, p)
			if err != nil {
				h.violation("%s: acknowledged write %s in %s: read: %v", when, p, s.id, err)
				continue
			}
			b, err := io.ReadAll(rc)
			rc.Close()
			if err != nil || sha(b) != s.files[p] {
				h.violation("%s: acknowledged write %s in %s reads back %d bytes with sha256 %s (err %v), want %s", when, p, s.id, len(b), sha(b), err, s.files[p])
			} else {
				h.verified("files")
			}
		}
	}
	// Sandboxes no answer named (a create or fork whose answer was cut):
	// their state was checked above; they are deleted.
	for _, sb := range all {
		if known[sb.ID] {
			continue
		}
		h.n.unacked++
		if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
			h.violation("%s: delete %s (%s), a sandbox no answer named: %v", when, sb.ID, sb.State, err)
		}
	}
}

// cleanup deletes every sandbox, checks nothing of them is left and stops
// the server.
func (h *crashHarness) cleanup() {
	t := h.t
	p := h.p
	if !p.up {
		p.start()
	}
	ctx := context.Background()
	all, _ := h.c.ListSandboxes(ctx)
	for _, sb := range all {
		if err := h.c.DeleteSandbox(ctx, sb.ID); err != nil {
			t.Errorf("cleanup: delete %s: %v", sb.ID, err)
		}
	}
	// The running server's prepared containers stay until its shutdown.
	instances := func() map[string][]string {
		m := h.runscInstances()
		for inst := range m {
			if strings.HasPrefix(inst, unclaimedPrefix) {
				delete(m, inst)
			}
		}
		return m
	}
	deadline := time.Now().Add(30 * time.Second)
	for len(instances()) > 0 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	if left := instances(); len(left) > 0 {
		t.Errorf("runsc processes left after every sandbox was deleted: %v", left)
	}
	p.stop()
	if left := h.unclaimedPrepared(); len(left) > 0 {
		t.Errorf("prepared containers left after the server's shutdown: %v", left)
	}
	if t.Failed() {
		t.Logf("server log:\n%s", tail(p.logText(), 8000))
	}
}
