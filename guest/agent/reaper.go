package agent

import (
	"errors"
	"log"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"
)

// reaper is the one place that calls wait4. Every process the agent starts is forked
// by reaper.start, which holds the lock across fork and registration, so a reap pass
// (which also holds it) can never collect a status before its waiter is registered.
type reaper struct {
	lock    chan struct{} // a mutex (capacity 1) that a start can stop waiting for
	all     bool          // reap every child (PID 1), not only registered ones
	waiters map[int]chan syscall.WaitStatus
	log     *log.Logger
}

var (
	reaperOnce sync.Once
	theReaper  *reaper
)

// getReaper returns the process-wide reaper, starting it on first use. all (or being
// PID 1) selects reap-everything mode; it only counts on the first call.
func getReaper(all bool, lg *log.Logger) *reaper {
	reaperOnce.Do(func() {
		r := &reaper{
			lock:    make(chan struct{}, 1),
			all:     all || os.Getpid() == 1,
			waiters: make(map[int]chan syscall.WaitStatus),
			log:     lg,
		}
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGCHLD)
		go func() {
			tick := time.NewTicker(time.Second)
			defer tick.Stop()
			for {
				select {
				case <-sig:
				case <-tick.C:
				}
				r.reap()
			}
		}()
		theReaper = r
	})
	return theReaper
}

// errGaveUp is start's error when stop was closed before the fork could begin.
var errGaveUp = errors.New("gave up waiting to start")

// start forks argv0 with attr and registers the child. The returned channel receives
// the child's wait status once (it is buffered; nobody has to read it). While
// another start or a reap pass holds the lock it waits, until stop is closed
// (nil: for as long as it takes); then it returns errGaveUp.
func (r *reaper) start(stop <-chan struct{}, argv0 string, argv []string, attr *syscall.ProcAttr) (int, <-chan syscall.WaitStatus, error) {
	select {
	case r.lock <- struct{}{}:
	case <-stop:
		return 0, nil, errGaveUp
	}
	defer func() { <-r.lock }()
	pid, err := syscall.ForkExec(argv0, argv, attr)
	if err != nil {
		return 0, nil, err
	}
	ch := make(chan syscall.WaitStatus, 1)
	r.waiters[pid] = ch
	return pid, ch, nil
}

func (r *reaper) reap() {
	r.lock <- struct{}{}
	defer func() { <-r.lock }()
	if r.all {
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if err == syscall.EINTR {
				continue
			}
			if err != nil || pid <= 0 {
				return
			}
			if ch, ok := r.waiters[pid]; ok {
				ch <- ws
				delete(r.waiters, pid)
			} else if r.log != nil {
				r.log.Printf("reaped orphan pid %d (status %#x)", pid, uint32(ws))
			}
		}
	}
	for pid, ch := range r.waiters {
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		for err == syscall.EINTR {
			got, err = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		}
		switch {
		case got == pid:
			ch <- ws
			delete(r.waiters, pid)
		case err == syscall.ECHILD:
			// Someone else collected it; report exit status 255.
			ch <- syscall.WaitStatus(255 << 8)
			delete(r.waiters, pid)
		}
	}
}
