package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/state"
)

// server maps the v1 API onto a state.Manager.
type server struct {
	m       *state.Manager
	log     *slog.Logger
	met     *metrics
	info    api.VersionInfo
	handler http.Handler
}

func newServer(m *state.Manager, met *metrics, reg *prometheus.Registry, log *slog.Logger, info api.VersionInfo) *server {
	s := &server{m: m, log: log, met: met, info: info}
	mux := http.NewServeMux()
	route := func(pattern string, h http.HandlerFunc) {
		name := pattern
		mux.Handle(pattern, s.instrument(name, h))
	}
	route("GET /v1/version", s.version)
	route("GET /v1/sandboxes", s.list)
	route("POST /v1/sandboxes", s.create)
	route("GET /v1/sandboxes/{name}", s.get)
	route("DELETE /v1/sandboxes/{name}", s.remove)
	route("POST /v1/sandboxes/{name}/exec", s.exec)
	route("POST /v1/sandboxes/{name}/sessions", s.startSession)
	route("GET /v1/sandboxes/{name}/sessions", s.sessions)
	route("DELETE /v1/sandboxes/{name}/sessions/{id}", s.stopSession)
	route("POST /v1/sandboxes/{name}/sessions/{id}/send", s.send)
	route("POST /v1/sandboxes/{name}/turn", s.turn)
	route("POST /v1/sandboxes/{name}/checkpoint", s.checkpoint)
	route("POST /v1/sandboxes/{name}/restore", s.restore)
	route("GET /v1/sandboxes/{name}/log", s.logTree)
	route("GET /v1/sandboxes/{name}/usage", s.usage)
	route("GET /v1/sandboxes/{name}/reports", s.reports)
	route("GET /v1/checkpoints/{id}", s.getCheckpoint)
	route("POST /v1/checkpoints/{id}/wait", s.wait)
	route("POST /v1/checkpoints/{id}/fork", s.fork)
	route("GET /v1/pins", s.pins)
	route("POST /v1/pins", s.pin)
	route("POST /v1/unpin", s.unpin)
	route("POST /v1/gc", s.gc)
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, &state.Error{Code: state.CodeNotFound, Msg: "no route " + r.Method + " " + r.URL.Path + " (API " + api.Version + ")"})
	})
	s.handler = mux
	return s
}

func (s *server) instrument(route string, h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		h(w, r)
		s.met.request(route, time.Since(start))
	})
}

func status(code string) int {
	switch code {
	case state.CodeNotFound:
		return http.StatusNotFound
	case state.CodeExists, state.CodeConflict:
		return http.StatusConflict
	case state.CodeBadRequest:
		return http.StatusBadRequest
	case state.CodeStaleEpoch:
		return http.StatusPreconditionFailed
	case state.CodeNotReady:
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

func errBody(err error) api.ErrorBody {
	code := state.CodeOf(err)
	// A call cut short (its client went, the daemon stops) is a conflict,
	// unless the error already says what it is: a policy whose start
	// function ran out of time is a bad request, not a conflict.
	var se *state.Error
	if !errors.As(err, &se) && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		code = state.CodeConflict
	}
	return api.ErrorBody{Code: code, Message: err.Error()}
}

func writeErr(w http.ResponseWriter, err error) {
	b := errBody(err)
	writeJSON(w, status(b.Code), api.Error{Error: b})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

// writeJSONNow is writeJSON with the answer on the wire when it returns
// (a length and a flush), for handlers that go on working after it.
func writeJSONNow(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeErr(w, fmt.Errorf("encode the answer: %w", err))
		return
	}
	b = append(b, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(code)
	w.Write(b)
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
}

// decode reads a JSON body (an empty body is an empty object).
func decode(r *http.Request, v any) error {
	dec := json.NewDecoder(io.LimitReader(r.Body, 16<<20))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil && !errors.Is(err, io.EOF) {
		return &state.Error{Code: state.CodeBadRequest, Msg: "bad request body", Err: err}
	}
	return nil
}

func (s *server) version(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.info)
}

func (s *server) list(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, api.SandboxList{Sandboxes: s.m.List()})
}

func (s *server) create(w http.ResponseWriter, r *http.Request) {
	var req api.CreateRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	sb, err := s.m.Create(r.Context(), state.CreateRequest{Name: req.Name, Bases: req.Bases, FS: req.FS, Policy: req.Policy})
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, sb)
}

func (s *server) get(w http.ResponseWriter, r *http.Request) {
	sb, err := s.m.Get(r.PathValue("name"))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, sb)
}

func (s *server) remove(w http.ResponseWriter, r *http.Request) {
	if err := s.m.Remove(r.Context(), r.PathValue("name")); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, struct{}{})
}

// frameWriter turns writes into exec frames on a streaming response.
type frameWriter struct {
	mu     *sync.Mutex
	enc    *json.Encoder
	fl     http.Flusher
	stderr bool
}

func (f *frameWriter) Write(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fr := api.ExecFrame{Stdout: string(p)}
	if !utf8.Valid(p) {
		fr.StdoutB64 = p
	}
	if f.stderr {
		fr = api.ExecFrame{Stderr: fr.Stdout, StderrB64: fr.StdoutB64}
	}
	if err := f.enc.Encode(fr); err != nil {
		return 0, err
	}
	if f.fl != nil {
		f.fl.Flush()
	}
	return len(p), nil
}

func (s *server) exec(w http.ResponseWriter, r *http.Request) {
	var req api.ExecRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/x-ndjson")
	var mu sync.Mutex
	enc := json.NewEncoder(w)
	fl, _ := w.(http.Flusher)
	started := false
	start := func() {
		if !started {
			started = true
			w.WriteHeader(http.StatusOK)
		}
	}
	out := &frameWriter{mu: &mu, enc: enc, fl: fl}
	errw := &frameWriter{mu: &mu, enc: enc, fl: fl, stderr: true}
	var stdin io.Reader
	switch {
	case req.Stdin != "" && req.StdinB64 != nil:
		writeErr(w, &state.Error{Code: state.CodeBadRequest, Msg: "exec: stdin and stdin_b64 are both set (send one)"})
		return
	case req.Stdin != "":
		stdin = strings.NewReader(req.Stdin)
	case req.StdinB64 != nil:
		stdin = bytes.NewReader(req.StdinB64)
	}
	// Headers go out once the command starts (so early errors get a status).
	lazy := &lazyStart{start: start, mu: &mu}
	code, err := s.m.Exec(r.Context(), r.PathValue("name"), req.Epoch, state.ExecRequest{
		Argv: req.Argv, Env: req.Env, Dir: req.Dir, Stdin: stdin,
		Stdout: io.MultiWriter(lazy, out), Stderr: io.MultiWriter(lazy, errw),
	})
	mu.Lock()
	defer mu.Unlock()
	if err != nil && !started {
		writeErr(w, err)
		return
	}
	start()
	if err != nil {
		b := errBody(err)
		enc.Encode(api.ExecFrame{Error: &b})
		return
	}
	enc.Encode(api.ExecFrame{Exit: &code})
}

type lazyStart struct {
	start func()
	mu    *sync.Mutex
}

func (l *lazyStart) Write(p []byte) (int, error) {
	l.mu.Lock()
	l.start()
	l.mu.Unlock()
	return len(p), nil
}

func (s *server) startSession(w http.ResponseWriter, r *http.Request) {
	var req api.SessionRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	id, err := s.m.StartSession(r.Context(), r.PathValue("name"), req.Epoch, req.ID, req.Argv, req.Env)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, api.SessionInfo{ID: id})
}

func (s *server) sessions(w http.ResponseWriter, r *http.Request) {
	ids, err := s.m.Sessions(r.Context(), r.PathValue("name"))
	if err != nil {
		writeErr(w, err)
		return
	}
	slices.Sort(ids)
	writeJSON(w, http.StatusOK, api.SessionList{Sessions: ids})
}

// stopSession takes the sandbox epoch the caller knows as ?epoch=N
// (optional, as in every call that changes a sandbox).
func (s *server) stopSession(w http.ResponseWriter, r *http.Request) {
	var epoch uint64
	if e := r.URL.Query().Get("epoch"); e != "" {
		n, err := strconv.ParseUint(e, 10, 64)
		if err != nil {
			writeErr(w, &state.Error{Code: state.CodeBadRequest, Msg: "epoch " + strconv.Quote(e) + " is not a number"})
			return
		}
		epoch = n
	}
	if err := s.m.StopSession(r.Context(), r.PathValue("name"), epoch, r.PathValue("id")); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, struct{}{})
}

func (s *server) send(w http.ResponseWriter, r *http.Request) {
	var req api.SendRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	if req.Turn != nil {
		// Refused before any step runs, like every bad request.
		if req.Turn.Epoch != 0 {
			writeErr(w, &state.Error{Code: state.CodeBadRequest, Msg: "send: turn.epoch must be 0 (the send's epoch applies to its turn)"})
			return
		}
		if _, err := state.ParseMode(req.Turn.Mode); err != nil {
			writeErr(w, fmt.Errorf("send: turn: %w", err))
			return
		}
	}
	name := r.PathValue("name")
	var res api.SendResult
	epoch := req.Epoch
	if req.Restore != "" {
		rr, err := s.doRestore(r, name, req.Restore, epoch)
		if err != nil {
			writeErr(w, err)
			return
		}
		res.Restore, epoch = rr, rr.Epoch
	}
	// Without --until the answer ends after 300 ms of quiet; with it, only
	// the match (or an explicit idle_ms) ends it.
	var idle time.Duration
	switch {
	case req.IdleMS > 0:
		idle = time.Duration(req.IdleMS) * time.Millisecond
	case req.Until == "":
		idle = 300 * time.Millisecond
	}
	timeout := time.Minute
	if req.TimeoutMS > 0 {
		timeout = time.Duration(req.TimeoutMS) * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(r.Context(), timeout+5*time.Second)
	defer cancel()
	sent := time.Now()
	out, err := s.m.Send(ctx, name, epoch, state.SendRequest{
		Session: r.PathValue("id"), Text: req.Text, Idle: idle, Until: req.Until, Timeout: timeout,
	})
	if err != nil {
		if res.Restore != nil {
			err = fmt.Errorf("send after the restore to %s (done, epoch %d): %w", req.Restore, epoch, err)
		}
		writeErr(w, err)
		return
	}
	res.Output, res.Ended, res.Exit, res.ElapsedUS = out.Output, out.Ended, out.Exit, time.Since(sent).Microseconds()
	if !utf8.ValidString(out.Output) {
		res.OutputB64 = []byte(out.Output)
	}
	if req.Turn != nil {
		treq := *req.Turn
		treq.Epoch = epoch
		// A deferred turn's checkpoint starts once this answer is out.
		hold := make(chan struct{})
		defer close(hold)
		tr, err := s.doTurn(r, treq, "", hold)
		if err != nil {
			writeErr(w, fmt.Errorf("turn after the send (done): %w", err))
			return
		}
		res.Turn = tr
		writeJSONNow(w, http.StatusOK, res)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// doTurn ends a turn (force, when set, overrides the mode); a deferred
// turn's checkpoint waits for hold to close (state.TurnRequest.Hold).
func (s *server) doTurn(r *http.Request, req api.TurnRequest, force state.Mode, hold <-chan struct{}) (*api.TurnResult, error) {
	start := time.Now()
	mode, err := state.ParseMode(req.Mode)
	if err != nil {
		return nil, err
	}
	if force != "" {
		mode = force
	}
	res, err := s.m.Turn(r.Context(), r.PathValue("name"), state.TurnRequest{Mode: mode, Wait: req.Wait, Epoch: req.Epoch, Defer: req.Defer && force == "", Hold: hold})
	if err != nil {
		return nil, err
	}
	s.met.turn(res.Decision, time.Since(start))
	return &api.TurnResult{TurnResult: *res, ElapsedUS: time.Since(start).Microseconds()}, nil
}

func (s *server) turnCall(w http.ResponseWriter, r *http.Request, force state.Mode) {
	var req api.TurnRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	// A deferred turn's checkpoint starts once this answer is out.
	hold := make(chan struct{})
	defer close(hold)
	res, err := s.doTurn(r, req, force, hold)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSONNow(w, http.StatusOK, res)
}

func (s *server) turn(w http.ResponseWriter, r *http.Request)       { s.turnCall(w, r, "") }
func (s *server) checkpoint(w http.ResponseWriter, r *http.Request) { s.turnCall(w, r, state.ModeFull) }

// doRestore restores sandbox name to checkpoint id.
func (s *server) doRestore(r *http.Request, name, id string, epoch uint64) (*api.RestoreResult, error) {
	start := time.Now()
	// A restore, once started, completes even if the client goes away:
	// a half-done restore is never left behind.
	res, err := s.m.Restore(context.WithoutCancel(r.Context()), name, id, epoch)
	if err != nil {
		return nil, err
	}
	return &api.RestoreResult{RestoreResult: *res, ElapsedUS: time.Since(start).Microseconds()}, nil
}

func (s *server) restore(w http.ResponseWriter, r *http.Request) {
	var req api.RestoreRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	res, err := s.doRestore(r, r.PathValue("name"), req.Checkpoint, req.Epoch)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func (s *server) logTree(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	sb, err := s.m.Get(name)
	if err != nil {
		writeErr(w, err)
		return
	}
	cks, err := s.m.Log(name)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, api.Log{Sandbox: sb, Checkpoints: cks, Pins: s.m.Pins()})
}

func (s *server) usage(w http.ResponseWriter, r *http.Request) {
	u, err := s.m.Usage(r.PathValue("name"))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, u)
}

// maxReportWait bounds the long poll of GET .../reports.
const maxReportWait = 5 * time.Minute

func (s *server) reports(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var after, waitMS uint64
	for _, p := range []struct {
		name string
		set  func(string) error
	}{
		{"after", func(v string) (err error) { after, err = strconv.ParseUint(v, 10, 64); return err }},
		{"wait_ms", func(v string) (err error) { waitMS, err = strconv.ParseUint(v, 10, 64); return err }},
	} {
		if v := q.Get(p.name); v != "" {
			if err := p.set(v); err != nil {
				writeErr(w, &state.Error{Code: state.CodeBadRequest, Msg: "bad " + p.name + " " + strconv.Quote(v), Err: err})
				return
			}
		}
	}
	// At most maxReportWait, as documented (clamped before the
	// multiplication, which would overflow).
	wait := time.Duration(min(waitMS, uint64(maxReportWait/time.Millisecond))) * time.Millisecond
	page, err := s.m.Reports(r.Context(), r.PathValue("name"), after, wait)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, page)
}

func (s *server) getCheckpoint(w http.ResponseWriter, r *http.Request) {
	c, err := s.m.GetCheckpoint(r.PathValue("id"))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, c)
}

func (s *server) wait(w http.ResponseWriter, r *http.Request) {
	c, err := s.m.Wait(r.Context(), r.PathValue("id"))
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, c)
}

func (s *server) fork(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	var req api.ForkRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	if req.Prepare {
		n, err := s.m.PrepareFork(r.Context(), r.PathValue("id"), req.Count)
		if err != nil {
			writeErr(w, err)
			return
		}
		writeJSON(w, http.StatusOK, api.ForkResult{Sandboxes: []string{}, Prepared: n, ElapsedUS: time.Since(start).Microseconds()})
		return
	}
	kids, err := s.m.Fork(context.WithoutCancel(r.Context()), state.ForkRequest{
		Checkpoint: r.PathValue("id"), Count: req.Count, Prefix: req.Prefix, NoWait: req.NoWait,
	})
	if err != nil {
		writeErr(w, err)
		return
	}
	res := api.ForkResult{Sandboxes: make([]string, len(kids)), ElapsedUS: time.Since(start).Microseconds()}
	for i, k := range kids {
		res.Sandboxes[i] = k.Name
	}
	writeJSON(w, http.StatusOK, res)
}

func (s *server) pins(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, api.PinList{Pins: s.m.Pins()})
}

func (s *server) pin(w http.ResponseWriter, r *http.Request) {
	var req api.PinRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	if err := s.m.Pin(req.IDs); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, api.PinList{Pins: s.m.Pins()})
}

func (s *server) unpin(w http.ResponseWriter, r *http.Request) {
	var req api.PinRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	if err := s.m.Unpin(req.IDs); err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, api.PinList{Pins: s.m.Pins()})
}

func (s *server) gc(w http.ResponseWriter, r *http.Request) {
	var req api.GCRequest
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	res, err := s.m.GC(context.WithoutCancel(r.Context()), req.DryRun)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}
