// Package resume is torpor's Go SDK for the resume contract: code running inside
// a torpor sandbox uses it to come back correctly after a hibernation, a resume
// or a fork (see docs/resume-contract.md).
//
// A memory snapshot restores a process exactly as it was: the same random
// generator state, the same cached times and tokens, pooled connections whose
// peers are long gone, and possibly a request that was sent but whose answer
// never arrived. Restored twice, it is a clone that shares all of that with its
// sibling. The guest agent detects every restore (the generation, kept by the
// host outside the snapshot, changes) and tells subscribed processes; this
// package turns that into hooks that run in a fixed order before the server
// forwards any request to the sandbox:
//
//  1. reseed registered math/rand/v2 sources from crypto/rand (RegisterRand,
//     NewRand);
//  2. in a clone, wipe fork-unsafe secrets (RegisterSecret) and move the intent
//     journals' fork-unsafe pending intents aside (Journal);
//  3. close pooled connections (http.DefaultTransport and RegisterTransport,
//     RegisterPool for other pools) — dropped, not probed;
//  4. the program's own hooks (OnResume), by order.
//
// Then the process acknowledges the event and the server goes on.
//
// # Protocol
//
// The agent keeps /run/torpor/generation (decimal, rewritten atomically before
// any event), /run/torpor/resume.json (the last resume event) and
// /run/torpor/clock_offset_ns (nanoseconds to add to the sandbox's wall clock to
// get the host's). On the unix socket /run/torpor/events it sends one JSON
// object per line: {"event":"hello","generation":N} on connect, and
// {"event":"resume","generation":N,"forked":bool,"host_time":"…","snapshot_id":"…","seq":K}
// on every resume and fork. A subscriber sends {"subscribe":true,"name":"…"}
// after connecting (answered by {"event":"subscribed"}) and {"ack":K} after its
// hooks ran. Outside a torpor sandbox the socket does not exist: Start returns
// an idle Runtime, Generation returns 0, hooks never fire.
//
// # Time
//
// Now is the sandbox's wall clock corrected by the agent's measured offset.
// Store expiries as wall-clock instants (ExpiryIn, Lease) and test them with
// Expired or Lease.Remaining: a token that expired while the sandbox was
// hibernated is then seen as expired.
//
// # Intents
//
// A Journal records each external action before it is made (Begin: tool, args
// and an idempotency key from crypto/rand, appended and fsynced) and its outcome
// after (Complete). After a resume or a restart, Pending lists the actions whose
// outcome is unknown; reconcile each by asking the external system or by
// retrying with the same key — never a new one. In a clone, pending intents not
// marked ForkSafe are moved to <path>.forked-<generation> and are not pending
// there: only the original retries them.
//
// # A worked agent
//
//	func main() {
//		ctx := context.Background()
//		rt, err := resume.Start(ctx, resume.Options{Name: "review-agent"})
//		if err != nil {
//			log.Printf("resume contract unavailable: %v", err) // still runs, unprotected
//		}
//		defer rt.Close()
//
//		rng := resume.NewRand() // reseeded on every resume: retry jitter differs per clone
//		apiKey := []byte(os.Getenv("FORGE_TOKEN"))
//		resume.RegisterSecret("forge token", &apiKey) // a clone must fetch its own
//
//		token := resume.NewLease(55 * time.Minute) // model API token lifetime
//		resume.OnResume(0, func(ctx context.Context, ev resume.Event) error {
//			log.Printf("resumed: generation %d, clone %v", ev.Generation, ev.Forked)
//			return nil
//		})
//
//		j, err := resume.OpenJournal("/home/agent/intents.jsonl")
//		if err != nil {
//			log.Fatal(err)
//		}
//		// Reconcile what a previous life left half done: same key, so the forge
//		// creates the pull request at most once.
//		for _, in := range j.Pending() {
//			out, err := createPR(ctx, in.Key, in.Args, apiKey)
//			if err == nil {
//				j.Complete(in.Key, out)
//			}
//		}
//
//		for task := range tasks() {
//			if !token.ValidFor(time.Minute) { // counts time spent hibernated
//				token = refreshToken(ctx)
//			}
//			time.Sleep(time.Duration(rng.IntN(500)) * time.Millisecond)
//			in, err := j.Begin("create_pr", task) // on disk before the call
//			if err != nil {
//				log.Fatal(err)
//			}
//			out, err := createPR(ctx, in.Key, in.Args, apiKey) // may hibernate mid-call
//			if err != nil {
//				continue // stays pending; reconciled on the next start or resume
//			}
//			j.Complete(in.Key, out)
//		}
//	}
//
// After a resume the runtime closes http.DefaultTransport's idle connections
// before the agent sends anything, so createPR dials afresh instead of failing
// on a connection the forge closed long ago. A resume hook can also reconcile
// j.Pending() itself.
package resume
