# torpor — set-up, build and test.
#   make setup   install what torpor needs (Debian packages, pinned runsc and versitygw); idempotent
#   make build   build bin/torpor and bin/torpor-agent
#   make test    setup + build + go test (real runsc sandboxes; run as root)
#   make run     setup + build + the quickstart
#   make bench   the resume benchmark (20 cycles at 64 MiB and 512 MiB)
#   make soak    the crash harness (50 SIGKILLs of the server amid sandbox calls), then the load soak
#                (SOAK_DURATION, default 30m, of many small sandboxes; leak trends) (docs/operations.md)
#   make fuzz    every fuzz target for FUZZTIME (default 60s), one after another (docs/fuzzing.md)
#   make proto   regenerate the E2B envd Go code in api/e2b/envd/gen from its .proto files

# runsc has no tagged versions on the Go module proxy; this pseudo-version is pinned
# and measured (docs/decisions/gvisor-engine.md).
RUNSC_VERSION ?= v0.0.0-20260905035102-160fafc42237
TOOLS         := $(CURDIR)/.tools
RUNSC         := $(TOOLS)/runsc-$(RUNSC_VERSION)
# `make runsc-readers` (not part of setup) builds a runsc whose restore has
# RUNSC_READERS parallel page readers instead of 128 (not a flag at this version;
# measured, not adopted: docs/decisions/patched-runsc.md). Use it with TORPOR_RUNSC.
RUNSC_READERS ?= 4
RUNSC_FEW_READERS := $(TOOLS)/build/runsc-$(RUNSC_VERSION)-readers$(RUNSC_READERS)
# versitygw (Apache-2.0) is the S3-compatible server the snapshot store's S3 tests
# start; pinned, built once into .tools (snapshot/chunked/s3test.Version).
VERSITYGW_VERSION ?= v1.8.0
VERSITYGW     := $(TOOLS)/versitygw-$(VERSITYGW_VERSION)
GO            ?= go
export PATH   := $(CURDIR)/bin:$(TOOLS)/bin:/usr/local/go/bin:$(PATH)
export TORPOR_RUNSC := $(RUNSC)
export TORPOR_VERSITYGW := $(VERSITYGW)

.PHONY: setup build test run bench soak fuzz clean packages node-packages proto runsc-readers

# setup: Debian packages, the pinned runsc (built once, cached in .tools), the
# torpor binaries, and the built-in images in the host's build cache
# (/var/cache/torpor/images; each built once: base ~30 s, e2b-base, the image of
# E2B's template "base", 1–2 min). Idempotent; seconds when done.
setup: packages node-packages $(RUNSC) $(VERSITYGW) build
	bin/torpor image warm

packages:
	@bash scripts/install-packages.sh

# node-packages: E2B's npm SDK at the versions in e2e/e2bsdk/package-lock.json, for the
# tests that drive torpor with it. npm ci runs only when the lock file is newer than
# what is installed.
E2BSDK := e2e/e2bsdk
node-packages: $(E2BSDK)/node_modules/.package-lock.json

$(E2BSDK)/node_modules/.package-lock.json: $(E2BSDK)/package.json $(E2BSDK)/package-lock.json | packages
	cd $(E2BSDK) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# proto: protoc (Debian's, installed on demand) with protoc-gen-go and
# protoc-gen-connect-go built at the versions go.mod pins.
ENVD_PROTO := api/e2b/envd/proto
ENVD_GEN   := api/e2b/envd/gen
proto:
	@bash scripts/install-packages.sh --proto
	$(GO) build -o bin/protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go
	$(GO) build -o bin/protoc-gen-connect-go connectrpc.com/connect/cmd/protoc-gen-connect-go
	rm -rf $(ENVD_GEN)
	mkdir -p $(ENVD_GEN)
	protoc -I $(ENVD_PROTO) \
		--plugin=protoc-gen-go=bin/protoc-gen-go --go_out=$(ENVD_GEN) --go_opt=paths=source_relative \
		--plugin=protoc-gen-connect-go=bin/protoc-gen-connect-go \
		--connect-go_out=$(ENVD_GEN) --connect-go_opt=paths=source_relative \
		process/process.proto filesystem/filesystem.proto

$(RUNSC):
	@mkdir -p $(TOOLS)/build
	@echo "building runsc $(RUNSC_VERSION) (once; about 90 s)"
	cd $(TOOLS)/build && CGO_ENABLED=0 GOFLAGS=-mod=mod GOBIN=$(TOOLS)/build \
		$(GO) install -ldflags='-s -w' gvisor.dev/gvisor/runsc@$(RUNSC_VERSION)
	mv $(TOOLS)/build/runsc $(RUNSC)

runsc-readers: $(RUNSC_FEW_READERS)

# $(RUNSC_FEW_READERS): the pinned module's source (go mod download), copied to .tools/build,
# with one line changed: the restore's pages-file reader gets RUNSC_READERS parallel
# reads instead of pagesFileFDDefaultMaxParallel (128, which the checkpoint's writer
# keeps). The build fails if that line is not there exactly once (another version),
# rather than build an unpatched runsc.
RUNSC_SRC     = $(TOOLS)/build/gvisor-$(RUNSC_VERSION)-readers$(RUNSC_READERS)
RUNSC_PATCHED = pkg/sentry/state/stateio/pagesfile.go
RUNSC_LINE    = return NewPagesFileFDReader(fd, pagesFileFDDefaultMaxIOBytes, pagesFileFDDefaultMaxParallel)
RUNSC_NEWLINE = return NewPagesFileFDReader(fd, pagesFileFDDefaultMaxIOBytes, $(RUNSC_READERS))
$(RUNSC_FEW_READERS):
	@mkdir -p $(TOOLS)/build
	@echo "building runsc $(RUNSC_VERSION) with $(RUNSC_READERS) page readers (once; 2–9 min)"
	rm -rf $(RUNSC_SRC)
	cd $(TOOLS)/build && cp -r "$$(GOFLAGS=-mod=mod $(GO) mod download -json gvisor.dev/gvisor@$(RUNSC_VERSION) \
		| sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p')" $(RUNSC_SRC)
	chmod -R u+w $(RUNSC_SRC)
	test "$$(grep -cxF '	$(RUNSC_LINE)' $(RUNSC_SRC)/$(RUNSC_PATCHED))" = 1 || \
		{ echo "runsc: '$(RUNSC_LINE)' not once in $(RUNSC_PATCHED)" >&2; exit 1; }
	sed -i 's/^	$(RUNSC_LINE)$$/	$(RUNSC_NEWLINE)/' $(RUNSC_SRC)/$(RUNSC_PATCHED)
	test "$$(grep -cxF '	$(RUNSC_NEWLINE)' $(RUNSC_SRC)/$(RUNSC_PATCHED))" = 1
	cd $(RUNSC_SRC) && CGO_ENABLED=0 GOFLAGS=-mod=mod $(GO) build -ldflags='-s -w' -o $(RUNSC_SRC).bin ./runsc
	mv $(RUNSC_SRC).bin $(RUNSC_FEW_READERS)
	rm -rf $(RUNSC_SRC)

$(VERSITYGW):
	@mkdir -p $(TOOLS)/build
	@echo "building versitygw $(VERSITYGW_VERSION) (once; 2–9 min)"
	cd $(TOOLS)/build && CGO_ENABLED=0 GOFLAGS=-mod=mod GOBIN=$(TOOLS)/build \
		$(GO) install -ldflags='-s -w' github.com/versity/versitygw/cmd/versitygw@$(VERSITYGW_VERSION)
	mv $(TOOLS)/build/versitygw $(VERSITYGW)

build:
	CGO_ENABLED=0 $(GO) build -o bin/torpor-agent ./cmd/torpor-agent
	CGO_ENABLED=0 $(GO) build -o bin/torpor ./cmd/torpor

test: setup
	$(GO) vet ./...
	$(GO) test -count=1 -timeout 60m -p 1 ./...

run: setup
	bin/torpor quickstart

bench: setup
	bash scripts/bench.sh --cycles 20 --working-set 64MiB,512MiB

# soak: TestCrashHarness with 50 kills (make test runs its short form, 5 kills),
# then TestLoadSoak for SOAK_DURATION (make test skips it); SOAK_SANDBOXES sets
# its number of sandboxes (default: what a twelfth of the available memory holds).
SOAK_DURATION ?= 30m
SOAK_SANDBOXES ?=
soak: setup
	TORPOR_CRASH_KILLS=50 $(GO) test -count=1 -timeout 60m -run '^TestCrashHarness$$' -v ./e2e
	TORPOR_SOAK_DURATION=$(SOAK_DURATION) TORPOR_SOAK_SANDBOXES=$(SOAK_SANDBOXES) \
		$(GO) test -count=1 -timeout 6h -run '^TestLoadSoak$$' -v ./e2e

# fuzz: each decoder of outside bytes fuzzed for FUZZTIME in turn (their seed
# corpora, testdata/fuzz/, run in every `make test`). New inputs that widen
# coverage go to Go's fuzz cache; a failing one is written to the package's
# testdata/fuzz/<target>/ and the run stops. FUZZFLAGS adds go test flags, e.g.
# -parallel=1 on a shared host; minimizing each new input is capped at 2 s so
# the time goes to new inputs.
FUZZTIME  ?= 60s
FUZZFLAGS ?=
FUZZ_TARGETS := \
	./snapshot/chunked:FuzzManifest ./snapshot/chunked:FuzzPackIndex ./snapshot/chunked:FuzzChunker \
	./snapshot/local:FuzzManifest \
	./image:FuzzExtractTar ./image:FuzzImportArchive \
	./server:FuzzRequestBody \
	./api/e2b:FuzzControlBody ./api/e2b:FuzzListQuery ./api/e2b:FuzzRoute \
	./guest/agent:FuzzAgentRequest ./guest/agentclient:FuzzAgentAnswers \
	./sdk/go/resume:FuzzJournal ./sdk/go/resume:FuzzParseEvent \
	./apikey:FuzzKeyHeaders
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t#*:}; \
		echo "== $$name ($$pkg, $(FUZZTIME))"; \
		$(GO) test -run='^$$' -fuzz="^$$name\$$" -fuzztime=$(FUZZTIME) -fuzzminimizetime=2s $(FUZZFLAGS) $$pkg; \
	done

clean:
	rm -rf bin
