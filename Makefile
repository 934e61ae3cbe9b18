# rewind — see README.md. Every target that runs rewind builds it first.
GO        ?= go
BIN       := bin/rewind
STATICCHECK_VERSION := v0.8.2
GOTESTFLAGS ?= -count=1 -timeout 25m
# Nothing in rewind needs cgo; without it the sandbox init starts faster
# (it need not re-execute itself to drop privileges on every thread).
export CGO_ENABLED ?= 0

.PHONY: all build deps test demo bench lint policies clean

all: build

build:
	$(GO) build -trimpath -o $(BIN) ./cmd/rewind
	$(GO) build -trimpath -o bin/rewind-init ./cmd/rewind-init

# Debian packages and CRIU >= 4 (built from source into /opt/rewind/criu when needed).
deps:
	@bash scripts/deps.sh

test: deps build
	$(GO) test $(GOTESTFLAGS) ./...

demo: deps build
	@if ./$(BIN) demo --help >/dev/null 2>&1; then ./$(BIN) demo; else \
		echo "rewind demo is not in this build yet: running rewind doctor"; ./$(BIN) doctor; fi

bench: deps build
	@bash scripts/bench.sh

lint:
	$(GO) vet ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

# Rebuild the built-in WASM policies (committed; CI checks they match their sources).
policies:
	@bash scripts/build-policies.sh

clean:
	rm -rf bin
	$(GO) clean -testcache
