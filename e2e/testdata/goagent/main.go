// Command goagent is a small long-running program that uses torpor's Go SDK
// (sdk/go/resume) inside a sandbox, for e2e/hazards_test.go: it holds a
// user-space random source with a fixed seed, a fork-unsafe secret and an intent
// journal with one pending intent, and answers GET /state on the port given as
// its argument.
package main

import (
	"context"
	"encoding/json"
	"log"
	mrand "math/rand/v2"
	"net/http"
	"os"
	"sync"

	"github.com/torpor/torpor/sdk/go/resume"
)

func main() {
	ctx := context.Background()
	rt, err := resume.Start(ctx, resume.Options{Name: "goagent"})
	if err != nil {
		log.Fatal(err)
	}
	var mu sync.Mutex
	src := mrand.NewChaCha8([32]byte{1, 2, 3}) // the state every clone inherits
	must(resume.RegisterRand(func(seed [32]byte) { mu.Lock(); src.Seed(seed); mu.Unlock() }))
	secret := []byte("s3cret")
	must(resume.RegisterSecret("token", &secret))
	j, err := resume.OpenJournal("/root/go-intents.jsonl")
	must(err)
	if len(j.Pending()) == 0 {
		_, err = j.Begin("create_pr", map[string]string{"title": "fix"})
		must(err)
	}
	var last resume.Event
	resume.OnResume(0, func(ctx context.Context, ev resume.Event) error {
		mu.Lock()
		last = ev
		mu.Unlock()
		return nil
	})
	http.HandleFunc("/state", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		gen, _ := resume.Generation()
		var keys []string
		for _, in := range j.Pending() {
			keys = append(keys, in.Key)
		}
		json.NewEncoder(w).Encode(map[string]any{
			"subscribed": rt.Subscribed(), "generation": gen, "hook_generation": last.Generation,
			"hook_forked": last.Forked, "draw": src.Uint64(), "secret": string(secret), "pending": keys,
		})
	})
	log.Fatal(http.ListenAndServe(":"+os.Args[1], nil))
}

func must(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
