package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/torpor/torpor/apiv1"
	"github.com/torpor/torpor/client"
	"github.com/torpor/torpor/workload"
)

// Defaults of Options' concurrency cases.
const (
	DefaultWakes      = 10 // sandboxes woken at once
	DefaultWakeRounds = 3  // rounds of concurrent wakes
	DefaultForkCycles = 5  // forks of each count
	// TargetWakesRatio: 10 concurrent wakes' p99 ≤ 3 × a single wake's p50.
	TargetWakesRatio = 3.0
	// TargetForkMS: fork of a running sandbox → first clone answers, p50.
	TargetForkMS = 200.0
	// TargetFork4Ratio: a fork of 4 → first clone answers ≤ 1.5 × a fork of 1.
	TargetFork4Ratio = 1.5
)

// measureWakes sets up n hibernated sandboxes running the workload with wsMiB
// MiB (memory memMiB) and wakes them all at once, rounds times (hibernating
// them again between rounds): each sample is one sandbox's time from the
// round's start to its first answer through the port proxy, in ms. The
// sandboxes are deleted at the end.
func measureWakes(ctx context.Context, c *client.Client, wsMiB, memMiB, n, rounds int) (samples []float64, err error) {
	ids := make([]string, n)
	counts := make([]int64, n)
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		for _, id := range ids {
			if id != "" {
				if derr := c.DeleteSandbox(dctx, id); derr != nil && err == nil {
					err = fmt.Errorf("bench: delete sandbox %s: %w", id, derr)
				}
			}
		}
	}()
	never := 0
	each := func(f func(i int) error) error {
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() { defer wg.Done(); errs[i] = f(i) }()
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	// Set up four at a time: all at once would measure create, not wakes.
	sem := make(chan struct{}, 4)
	if err := each(func(i int) error {
		sem <- struct{}{}
		defer func() { <-sem }()
		sb, err := c.CreateSandbox(ctx, apiv1.CreateSandboxRequest{Image: "base", MemoryMiB: memMiB, IdleTimeoutS: &never, PauseAfterS: &never})
		if err != nil {
			return fmt.Errorf("bench: create sandbox: %w", err)
		}
		ids[i] = sb.ID
		if err := workload.Start(ctx, c, sb.ID, wsMiB); err != nil {
			return err
		}
		st, err := workload.Get(ctx, c, sb.ID, "/count")
		counts[i] = st.Count
		return err
	}); err != nil {
		return nil, err
	}
	for r := range rounds {
		if err := each(func(i int) error {
			sem <- struct{}{}
			defer func() { <-sem }()
			if _, err := c.Hibernate(ctx, ids[i]); err != nil {
				return fmt.Errorf("bench: hibernate %s: %w", ids[i], err)
			}
			return nil
		}); err != nil {
			return samples, err
		}
		took := make([]float64, n)
		start := time.Now()
		if err := each(func(i int) error {
			st, err := workload.Get(ctx, c, ids[i], "/count")
			took[i] = msOf(time.Since(start))
			if err != nil {
				return fmt.Errorf("bench: round %d: wake %s: %w", r+1, ids[i], err)
			}
			if st.Count != counts[i]+1 {
				return fmt.Errorf("bench: round %d: %s's counter did not continue: %d, then %d", r+1, ids[i], counts[i], st.Count)
			}
			counts[i] = st.Count
			return nil
		}); err != nil {
			return samples, err
		}
		samples = append(samples, took...)
	}
	return samples, nil
}

// measureFork forks running sandbox id (its workload answering) cycles
// times with count 1 and cycles times with count 4, deleting the clones after
// each: one1 is the fork call until its clone's first answer through the port
// proxy; first4 the fork of 4 until its first clone answers, all4 until every
// clone has; all in ms. The forks answer with their first clone (wait
// "first"), so the first clone's time does not include the others' starts.
func measureFork(ctx context.Context, c *client.Client, id string, cycles int) (one1, first4, all4 []float64, err error) {
	var clones []string
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		for _, cl := range clones {
			_ = c.DeleteSandbox(dctx, cl)
		}
	}()
	fork := func(count int) (first, all float64, err error) {
		start := time.Now()
		// wait "first": the call answers once the first clone runs; the
		// requests below to the others wait for their starts.
		sbs, err := c.ForkWith(ctx, id, apiv1.ForkRequest{Count: count, Wait: apiv1.ForkWaitFirst})
		for _, sb := range sbs {
			clones = append(clones, sb.ID)
		}
		if err != nil {
			return 0, 0, fmt.Errorf("bench: fork %s (count %d): %w", id, count, err)
		}
		if len(sbs) != count {
			return 0, 0, fmt.Errorf("bench: fork %s (count %d) made %d clones", id, count, len(sbs))
		}
		for i, sb := range sbs {
			if _, err := workload.Get(ctx, c, sb.ID, "/count"); err != nil {
				return 0, 0, fmt.Errorf("bench: clone %s of %s: %w", sb.ID, id, err)
			}
			if i == 0 {
				first = msOf(time.Since(start))
			}
		}
		all = msOf(time.Since(start))
		dctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		for _, sb := range sbs {
			if err := c.DeleteSandbox(dctx, sb.ID); err != nil {
				return first, all, fmt.Errorf("bench: delete clone %s: %w", sb.ID, err)
			}
		}
		clones = clones[:0]
		return first, all, nil
	}
	for range cycles {
		f, _, err := fork(1)
		if err != nil {
			return one1, first4, all4, err
		}
		one1 = append(one1, f)
		f, a, err := fork(4)
		if err != nil {
			return one1, first4, all4, err
		}
		first4, all4 = append(first4, f), append(all4, a)
	}
	return one1, first4, all4, nil
}
