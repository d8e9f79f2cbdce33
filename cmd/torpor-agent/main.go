// Command torpor-agent is torpor's guest agent: the first process (PID 1) of every
// sandbox. It serves the host over HTTP on --listen (default :49983); see package
// github.com/torpor/torpor/guest/agent. It logs to /tmp/torpor-agent.log and never
// to stdout or stderr.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/torpor/torpor/guest/agent"
)

func main() {
	listen := flag.String("listen", fmt.Sprintf(":%d", agent.Port), "TCP address to serve the agent API on")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := agent.Run(ctx, *listen); err != nil {
		if f, ferr := os.OpenFile(agent.LogPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644); ferr == nil {
			fmt.Fprintf(f, "torpor-agent: %v\n", err)
			f.Close()
		}
		os.Exit(1)
	}
}
