package manager_test

import (
	"context"
	"sync"
	"testing"

	"github.com/torpor/torpor/manager"
	"github.com/torpor/torpor/metadata"
	"github.com/torpor/torpor/sandbox"
)

// hookedDB runs before once, before the first write (UpdateSandbox or
// ClaimSandbox) of a sandbox record that match says is the one: another
// node's call that lands between this node's read of the record and its
// write.
type hookedDB struct {
	metadata.Store
	match  func(s *metadata.Sandbox) bool
	before func()
	once   sync.Once
}

func (d *hookedDB) hook(s *metadata.Sandbox) {
	if d.match(s) {
		d.once.Do(d.before)
	}
}

func (d *hookedDB) UpdateSandbox(ctx context.Context, s *metadata.Sandbox) error {
	d.hook(s)
	return d.Store.UpdateSandbox(ctx, s)
}

func (d *hookedDB) ClaimSandbox(ctx context.Context, s *metadata.Sandbox) error {
	d.hook(s)
	return d.Store.ClaimSandbox(ctx, s)
}

// TestNodeRaces: calls on a sandbox no node owns, through node-a, whose
// record node-b changes between node-a's read and its write (the hook):
// the call reads the record again and is answered as for what it finds,
// never with the database's bare error (a server's 500): a delete that
// node-b deleted first, or marked first, is not found; a delete of a
// sandbox node-b resumed first is told it is node-b's (the server forwards
// it there); a resume or an exec of a sandbox node-b deleted first is not
// found; a policy update (PATCH) is told the owner or not found likewise; a
// recovery (resume from state error) that node-b recovered first is told
// it is node-b's. Each leaves one record (or none) as the winner left it.
func TestNodeRaces(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		// write is a's write the hook precedes (its sandbox record as a
		// is about to write it).
		write func(s *metadata.Sandbox) bool
		// first is what b does.
		first func(b *host, id string) error
		// then is a's call.
		then      func(a *host, id string) error
		fenced    bool // the sandbox is in state error off a lost node first
		wantKind  sandbox.Kind
		wantOwner string
	}{
		{name: "delete after a delete",
			write: func(s *metadata.Sandbox) bool { return s.Deleting },
			first: func(b *host, id string) error { return b.m.Delete(ctx, id) },
			then:  func(a *host, id string) error { return a.m.Delete(ctx, id) }, wantKind: sandbox.NotFound},
		{name: "delete after a delete's mark",
			write: func(s *metadata.Sandbox) bool { return s.Deleting },
			first: func(b *host, id string) error {
				r, err := b.db.GetSandbox(ctx, id)
				if err != nil {
					return err
				}
				r.Deleting = true
				return b.db.UpdateSandbox(ctx, r)
			},
			then: func(a *host, id string) error { return a.m.Delete(ctx, id) }, wantKind: sandbox.NotFound},
		{name: "delete after a resume",
			write: func(s *metadata.Sandbox) bool { return s.Deleting },
			first: func(b *host, id string) error { _, err := b.m.Resume(ctx, id); return err },
			then:  func(a *host, id string) error { return a.m.Delete(ctx, id) }, wantKind: sandbox.Conflict, wantOwner: "node-b"},
		{name: "resume after a delete",
			write: func(s *metadata.Sandbox) bool { return s.Owner == "node-a" },
			first: func(b *host, id string) error { return b.m.Delete(ctx, id) },
			then:  func(a *host, id string) error { _, err := a.m.Resume(ctx, id); return err }, wantKind: sandbox.NotFound},
		{name: "exec after a delete",
			write: func(s *metadata.Sandbox) bool { return s.Owner == "node-a" },
			first: func(b *host, id string) error { return b.m.Delete(ctx, id) },
			then: func(a *host, id string) error {
				_, err := a.m.Exec(ctx, id, sandbox.ExecRequest{Cmd: []string{"true"}})
				return err
			}, wantKind: sandbox.NotFound},
		{name: "update after a resume",
			write: func(s *metadata.Sandbox) bool { return s.TimeoutS == 600 },
			first: func(b *host, id string) error { _, err := b.m.Resume(ctx, id); return err },
			then: func(a *host, id string) error {
				secs := 600
				_, err := a.m.Update(ctx, id, sandbox.PolicyUpdate{TimeoutS: &secs})
				return err
			}, wantKind: sandbox.Conflict, wantOwner: "node-b"},
		{name: "update after a delete",
			write: func(s *metadata.Sandbox) bool { return s.TimeoutS == 600 },
			first: func(b *host, id string) error { return b.m.Delete(ctx, id) },
			then: func(a *host, id string) error {
				secs := 600
				_, err := a.m.Update(ctx, id, sandbox.PolicyUpdate{TimeoutS: &secs})
				return err
			}, wantKind: sandbox.NotFound},
		{name: "recovery after a recovery", fenced: true,
			write: func(s *metadata.Sandbox) bool { return s.State == sandbox.StateHibernated },
			first: func(b *host, id string) error { _, err := b.m.Resume(ctx, id); return err },
			then:  func(a *host, id string) error { _, err := a.m.Resume(ctx, id); return err }, wantKind: sandbox.Conflict, wantOwner: "node-b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newHost(t, hostOpts{node: "node-c"})
			b := newHost(t, hostOpts{node: "node-b", peer: c})
			var id string
			hooked := &hookedDB{match: func(s *metadata.Sandbox) bool { return s.ID == id && tc.write(s) }}
			a := newHost(t, hostOpts{node: "node-a", peer: c, db: func(db metadata.Store) metadata.Store { hooked.Store = db; return hooked }})
			sb := c.create()
			id = sb.ID
			if _, err := c.m.Hibernate(ctx, id, manager.HibernateOptions{}); err != nil {
				t.Fatal(err)
			}
			if tc.fenced {
				if _, err := c.m.Resume(ctx, id); err != nil {
					t.Fatal(err)
				}
				if ok, err := b.m.Fence(ctx, id, "node-c", "node node-c lost"); !ok || err != nil {
					t.Fatalf("fence: %v %v", ok, err)
				}
			}
			var firstErr error
			hooked.before = func() { firstErr = tc.first(b, id) }
			err := tc.then(a, id)
			if firstErr != nil {
				t.Fatalf("node-b first: %v", firstErr)
			}
			if sandbox.KindOf(err) != tc.wantKind || manager.OwnerOf(err) != tc.wantOwner {
				t.Errorf("node-a: %v (kind %v, owner %q); want kind %v, owner %q", err, sandbox.KindOf(err), manager.OwnerOf(err), tc.wantKind, tc.wantOwner)
			}
		})
	}
}
