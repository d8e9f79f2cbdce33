// Command torpor is the torpor server and command line; see package cli.
package main

import (
	"os"

	"github.com/torpor/torpor/cli"
)

func main() {
	os.Exit(cli.Execute())
}
