// Package client is the Go client of rewind's daemon API (v1, HTTP/JSON
// over a unix socket). The rewind CLI uses it for every command.
package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/state"
)

// Client talks to one daemon.
type Client struct {
	socket string
	hc     *http.Client
}

// SocketFromEnv returns $REWIND_SOCKET or the default socket path.
func SocketFromEnv() string {
	if s := os.Getenv("REWIND_SOCKET"); s != "" {
		return s
	}
	return api.DefaultSocket
}

// New returns a client for the daemon listening on socket.
func New(socket string) *Client {
	tr := &transport{socket: socket, maxIdle: 16}
	return &Client{socket: socket, hc: &http.Client{Transport: tr}}
}

// Socket is the socket path the client uses.
func (c *Client) Socket() string { return c.socket }

// Close releases idle connections.
func (c *Client) Close() { c.hc.CloseIdleConnections() }

// Error is an error answered by the daemon.
type Error struct {
	Status  int
	Code    string
	Message string
}

func (e *Error) Error() string { return e.Message }

// Is lets errors.Is match state sentinels (state.ErrStaleEpoch, ...).
func (e *Error) Is(target error) bool {
	var se *state.Error
	return errors.As(target, &se) && se.Msg == "" && se.Code == e.Code
}

// ErrNoDaemon is returned (wrapped) when nothing listens on the socket.
var ErrNoDaemon = errors.New("no rewind daemon is running")

func (c *Client) do(ctx context.Context, method, path string, body, out any) error {
	resp, err := c.send(ctx, method, path, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("%s %s: bad answer: %w", method, path, err)
	}
	return nil
}

func (c *Client) send(ctx context.Context, method, path string, body any) (*http.Response, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://rewind"+path, rd)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		var oe *net.OpError
		if errors.As(err, &oe) && oe.Op == "dial" {
			return nil, fmt.Errorf("%w on %s (%v)", ErrNoDaemon, c.socket, oe.Err)
		}
		return nil, err
	}
	if resp.StatusCode >= 300 {
		defer resp.Body.Close()
		var e api.Error
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		if json.Unmarshal(b, &e) != nil || e.Error.Message == "" {
			return nil, &Error{Status: resp.StatusCode, Code: state.CodeInternal, Message: fmt.Sprintf("%s %s: %s", method, path, resp.Status)}
		}
		return nil, &Error{Status: resp.StatusCode, Code: e.Error.Code, Message: e.Error.Message}
	}
	return resp, nil
}

func esc(s string) string { return url.PathEscape(s) }

// Version asks the daemon who it is; it is the cheapest liveness check.
func (c *Client) Version(ctx context.Context) (*api.VersionInfo, error) {
	var v api.VersionInfo
	return &v, c.do(ctx, "GET", "/v1/version", nil, &v)
}

// Create creates a sandbox.
func (c *Client) Create(ctx context.Context, req api.CreateRequest) (*state.Sandbox, error) {
	var sb state.Sandbox
	return &sb, c.do(ctx, "POST", "/v1/sandboxes", req, &sb)
}

// List lists sandboxes.
func (c *Client) List(ctx context.Context) ([]*state.Sandbox, error) {
	var l api.SandboxList
	return l.Sandboxes, c.do(ctx, "GET", "/v1/sandboxes", nil, &l)
}

// Get returns one sandbox.
func (c *Client) Get(ctx context.Context, name string) (*state.Sandbox, error) {
	var sb state.Sandbox
	return &sb, c.do(ctx, "GET", "/v1/sandboxes/"+esc(name), nil, &sb)
}

// Remove removes a sandbox.
func (c *Client) Remove(ctx context.Context, name string) error {
	return c.do(ctx, "DELETE", "/v1/sandboxes/"+esc(name), nil, nil)
}

// Exec runs a one-shot command, streaming its output to stdout and stderr,
// and returns its exit code.
func (c *Client) Exec(ctx context.Context, name string, req api.ExecRequest, stdout, stderr io.Writer) (int, error) {
	resp, err := c.send(ctx, "POST", "/v1/sandboxes/"+esc(name)+"/exec", req)
	if err != nil {
		return -1, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	for sc.Scan() {
		var f api.ExecFrame
		if err := json.Unmarshal(sc.Bytes(), &f); err != nil {
			return -1, fmt.Errorf("exec: bad frame: %w", err)
		}
		switch {
		case f.Error != nil:
			return -1, &Error{Status: 200, Code: f.Error.Code, Message: f.Error.Message}
		case f.Exit != nil:
			return *f.Exit, nil
		}
		b, isErr := f.Bytes()
		switch {
		case len(b) == 0:
		case isErr && stderr != nil:
			stderr.Write(b)
		case !isErr && stdout != nil:
			stdout.Write(b)
		}
	}
	if err := sc.Err(); err != nil {
		return -1, fmt.Errorf("exec: %w", err)
	}
	return -1, errors.New("exec: the daemon ended the stream without an exit code")
}

// StartSession starts a long-lived process; it returns the session id.
func (c *Client) StartSession(ctx context.Context, name string, req api.SessionRequest) (string, error) {
	var s api.SessionInfo
	err := c.do(ctx, "POST", "/v1/sandboxes/"+esc(name)+"/sessions", req, &s)
	return s.ID, err
}

// Sessions lists the ids of a sandbox's running sessions, sorted.
func (c *Client) Sessions(ctx context.Context, name string) ([]string, error) {
	var l api.SessionList
	err := c.do(ctx, "GET", "/v1/sandboxes/"+esc(name)+"/sessions", nil, &l)
	return l.Sessions, err
}

// StopSession kills a session's process and its process group and forgets
// the session. A non-zero epoch makes it fail if the sandbox was restored
// since.
func (c *Client) StopSession(ctx context.Context, name, session string, epoch uint64) error {
	p := "/v1/sandboxes/" + esc(name) + "/sessions/" + esc(session)
	if epoch != 0 {
		p += "?epoch=" + strconv.FormatUint(epoch, 10)
	}
	return c.do(ctx, "DELETE", p, nil, nil)
}

// Send writes text and a newline to a session and returns its answer.
func (c *Client) Send(ctx context.Context, name, session string, req api.SendRequest) (string, error) {
	r, err := c.Step(ctx, name, session, req)
	if err != nil {
		return "", err
	}
	return r.Output, nil
}

// Step is Send with the whole answer: with req.Restore and req.Turn it is
// one tree-search step in one call (restore, send, end the turn; see
// api.SendRequest). Output holds the exact bytes the session wrote (the
// answer's OutputB64 when it is not UTF-8). The ElapsedUS of the answer's Restore and Turn are the
// daemon's times of those steps; the call's own time is the caller's to
// measure.
func (c *Client) Step(ctx context.Context, name, session string, req api.SendRequest) (*api.SendResult, error) {
	var r api.SendResult
	if err := c.do(ctx, "POST", "/v1/sandboxes/"+esc(name)+"/sessions/"+esc(session)+"/send", req, &r); err != nil {
		return nil, err
	}
	if r.OutputB64 != nil {
		r.Output = string(r.OutputB64) // the exact bytes
	}
	return &r, nil
}

// Turn ends a turn. ElapsedUS in the result is the time this call took as
// the caller saw it.
func (c *Client) Turn(ctx context.Context, name string, req api.TurnRequest) (*api.TurnResult, error) {
	start := time.Now()
	var r api.TurnResult
	if err := c.do(ctx, "POST", "/v1/sandboxes/"+esc(name)+"/turn", req, &r); err != nil {
		return nil, err
	}
	r.ElapsedUS = time.Since(start).Microseconds()
	return &r, nil
}

// Checkpoint is Turn with mode full.
func (c *Client) Checkpoint(ctx context.Context, name string, wait bool, epoch uint64) (*api.TurnResult, error) {
	start := time.Now()
	var r api.TurnResult
	if err := c.do(ctx, "POST", "/v1/sandboxes/"+esc(name)+"/checkpoint", api.TurnRequest{Wait: wait, Epoch: epoch}, &r); err != nil {
		return nil, err
	}
	r.ElapsedUS = time.Since(start).Microseconds()
	return &r, nil
}

// Restore restores a sandbox to a checkpoint.
func (c *Client) Restore(ctx context.Context, name, ckpt string, epoch uint64) (*api.RestoreResult, error) {
	start := time.Now()
	var r api.RestoreResult
	if err := c.do(ctx, "POST", "/v1/sandboxes/"+esc(name)+"/restore", api.RestoreRequest{Checkpoint: ckpt, Epoch: epoch}, &r); err != nil {
		return nil, err
	}
	r.ElapsedUS = time.Since(start).Microseconds()
	return &r, nil
}

// Log returns a sandbox's checkpoint tree.
func (c *Client) Log(ctx context.Context, name string) (*api.Log, error) {
	var l api.Log
	return &l, c.do(ctx, "GET", "/v1/sandboxes/"+esc(name)+"/log", nil, &l)
}

// Usage returns what the sandbox's own checkpoints hold: fs layers and
// process images on disk, templates in memory.
func (c *Client) Usage(ctx context.Context, name string) (*state.Usage, error) {
	var u state.Usage
	return &u, c.do(ctx, "GET", "/v1/sandboxes/"+esc(name)+"/usage", nil, &u)
}

// Reports returns the sandbox's recent turn reports with a Seq after the
// cursor after (0: every report the daemon still holds). With wait > 0 and
// nothing newer yet, the daemon holds the call up to wait (at most 5
// minutes) for the next turn. Pass the answer's Last as the next cursor.
func (c *Client) Reports(ctx context.Context, name string, after uint64, wait time.Duration) (*state.ReportPage, error) {
	q := url.Values{}
	q.Set("after", strconv.FormatUint(after, 10))
	if wait > 0 {
		q.Set("wait_ms", strconv.FormatInt(max(wait.Milliseconds(), 1), 10))
	}
	var p state.ReportPage
	if err := c.do(ctx, "GET", "/v1/sandboxes/"+esc(name)+"/reports?"+q.Encode(), nil, &p); err != nil {
		return nil, err
	}
	return &p, nil
}

// GetCheckpoint returns one checkpoint.
func (c *Client) GetCheckpoint(ctx context.Context, id string) (*state.Checkpoint, error) {
	var ck state.Checkpoint
	return &ck, c.do(ctx, "GET", "/v1/checkpoints/"+esc(id), nil, &ck)
}

// Wait blocks until a checkpoint is durable (or its durable phase ended).
func (c *Client) Wait(ctx context.Context, id string) (*state.Checkpoint, error) {
	var ck state.Checkpoint
	return &ck, c.do(ctx, "POST", "/v1/checkpoints/"+esc(id)+"/wait", nil, &ck)
}

// Fork creates sandboxes from a checkpoint.
func (c *Client) Fork(ctx context.Context, ckpt string, req api.ForkRequest) (*api.ForkResult, error) {
	start := time.Now()
	var r api.ForkResult
	if err := c.do(ctx, "POST", "/v1/checkpoints/"+esc(ckpt)+"/fork", req, &r); err != nil {
		return nil, err
	}
	r.ElapsedUS = time.Since(start).Microseconds()
	return &r, nil
}

// Pin pins checkpoints and returns every pin.
func (c *Client) Pin(ctx context.Context, ids []string) ([]string, error) {
	var p api.PinList
	return p.Pins, c.do(ctx, "POST", "/v1/pins", api.PinRequest{IDs: ids}, &p)
}

// Unpin unpins checkpoints and returns the pins left.
func (c *Client) Unpin(ctx context.Context, ids []string) ([]string, error) {
	var p api.PinList
	return p.Pins, c.do(ctx, "POST", "/v1/unpin", api.PinRequest{IDs: ids}, &p)
}

// GC collects unreachable checkpoints.
func (c *Client) GC(ctx context.Context, dryRun bool) (*state.GCResult, error) {
	var r state.GCResult
	return &r, c.do(ctx, "POST", "/v1/gc", api.GCRequest{DryRun: dryRun}, &r)
}

// Metrics returns the Prometheus text exposition.
func (c *Client) Metrics(ctx context.Context) (string, error) {
	resp, err := c.send(ctx, "GET", "/metrics", nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}
