package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"github.com/rewind-sandbox/rewind/state"
)

// newStateCmds returns the product commands: sandboxes, turns, restore,
// fork, the tree, pins, GC, the daemon, bench and demo.
func newStateCmds() []*cobra.Command {
	return []*cobra.Command{
		newCreateCmd(), newExecCmd(), newSessionCmd(), newTurnCmd(), newCheckpointCmd(), newRestoreCmd(),
		newForkCmd(), newLsCmd(), newLogCmd(), newUsageCmd(), newRmCmd(), newPinCmd(), newUnpinCmd(), newGCCmd(),
		newDaemonCmd(), newBenchCmd(), newDemoCmd(),
	}
}

// clientOpts are the flags every client command shares.
type clientOpts struct {
	socket string
	json   bool
}

func (o *clientOpts) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&o.socket, "socket", "", "daemon socket (default $REWIND_SOCKET or "+api.DefaultSocket+")")
	cmd.Flags().BoolVar(&o.json, "json", false, "print JSON for scripts")
}

// connect returns a client, starting a daemon with default settings when
// none runs on the socket (and saying so on stderr).
func (o *clientOpts) connect(cmd *cobra.Command) (*client.Client, error) {
	sock := o.socket
	if sock == "" {
		sock = client.SocketFromEnv()
	}
	c := client.New(sock)
	ctx, cancel := context.WithTimeout(cmd.Context(), 5*time.Second)
	defer cancel()
	_, err := c.Version(ctx)
	if err == nil {
		return c, nil
	}
	if !errors.Is(err, client.ErrNoDaemon) {
		return nil, err
	}
	if os.Getenv("REWIND_NO_AUTOSTART") == "1" {
		return nil, err
	}
	pid, logPath, err := startDaemon(sock)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(cmd.Context(), time.Second)
		_, err = c.Version(ctx)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) || !processAlive(pid) {
			tail := lastLines(logPath, 3)
			return nil, fmt.Errorf("started a daemon (pid %d) but it did not come up on %s: %s", pid, sock, tail)
		}
		time.Sleep(50 * time.Millisecond)
	}
	fmt.Fprintf(cmd.ErrOrStderr(), "rewind: no daemon was running on %s; started one (pid %d, log %s)\n", sock, pid, logPath)
	return c, nil
}

// stateDirFromEnv is the state dir a command uses when not told one:
// $REWIND_STATE, else api.DefaultStateDir.
func stateDirFromEnv() string {
	if s := os.Getenv("REWIND_STATE"); s != "" {
		return s
	}
	return api.DefaultStateDir
}

// startDaemon starts `rewind daemon` detached, with the socket given and
// the state dir of the last daemon on that socket (api.StateRecord), else
// $REWIND_STATE, else the default. A $REWIND_STATE that names another
// state dir than the last daemon's is refused: the new daemon would not
// know the sandboxes of the last one, which stay until a daemon runs on
// their state dir again.
func startDaemon(sock string) (int, string, error) {
	self, err := os.Executable()
	if err != nil {
		return 0, "", err
	}
	stateDir := os.Getenv("REWIND_STATE")
	if b, err := os.ReadFile(api.StateRecord(sock)); err == nil {
		last := strings.TrimSpace(string(b))
		want := stateDir
		if want != "" {
			if abs, err := filepath.Abs(want); err == nil {
				want = abs
			}
		}
		switch _, err := os.Stat(last); {
		case err != nil:
			// The last daemon's state dir is gone: nothing to go back to.
		case want == "":
			stateDir = last
		case filepath.Clean(want) != filepath.Clean(last):
			return 0, "", fmt.Errorf("no daemon runs on %s, and the last one there used the state dir %s, not $REWIND_STATE %s: "+
				"start it again with `rewind daemon --socket %s --state %s` (or unset REWIND_STATE); to use %s, remove %s",
				sock, last, stateDir, sock, last, stateDir, api.StateRecord(sock))
		}
	}
	if stateDir == "" {
		stateDir = api.DefaultStateDir
	}
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		return 0, "", fmt.Errorf("start daemon: %w", err)
	}
	logPath := filepath.Join(stateDir, "daemon.log")
	lf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, "", fmt.Errorf("start daemon: %w", err)
	}
	defer lf.Close()
	args := []string{"daemon", "--socket", sock, "--state", stateDir}
	if b := os.Getenv("REWIND_BACKEND"); b != "" {
		args = append(args, "--backend", b)
	}
	cmd := exec.Command(self, args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.Dir = "/"
	detach(cmd)
	if err := cmd.Start(); err != nil {
		return 0, "", fmt.Errorf("start daemon: %w", err)
	}
	pid := cmd.Process.Pid
	go cmd.Wait()
	return pid, logPath, nil
}

func processAlive(pid int) bool {
	return syscall.Kill(pid, 0) == nil
}

func lastLines(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "no log"
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false) // a shell's ">" and "&" stay as they are
	return enc.Encode(v)
}

func ms(us int64) string { return fmt.Sprintf("%.2f ms", float64(us)/1000) }

func newCreateCmd() *cobra.Command {
	var o clientOpts
	var req api.CreateRequest
	cmd := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a sandbox (the host's root read-only, or stacked --base dirs)",
		Example: `  rewind create agent1
  rewind create agent1 --base /srv/images/python --base /srv/project --policy effects`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			req.Name = args[0]
			for i, b := range req.Bases {
				if abs, err := filepath.Abs(b); err == nil {
					req.Bases[i] = abs
				}
			}
			if p := req.Policy; (strings.Contains(p, "/") || strings.HasSuffix(p, ".wasm")) && !filepath.IsAbs(p) {
				// The daemon reads the module: give it this directory's.
				abs, err := filepath.Abs(p)
				if err != nil {
					return fmt.Errorf("--policy: %w", err)
				}
				req.Policy = abs
			}
			sb, err := c.Create(cmd.Context(), req)
			if err != nil {
				return err
			}
			if o.json {
				// The API's answer: the sandbox as created (id, name, fs
				// chosen, policy, status, epoch...).
				return printJSON(cmd.OutOrStdout(), sb)
			}
			fmt.Fprintln(cmd.OutOrStdout(), sb.Name)
			return nil
		},
	}
	cmd.Flags().StringArrayVar(&req.Bases, "base", nil, "read-only base directory (repeatable, bottom first); default: the host's root")
	cmd.Flags().StringVar(&req.FS, "fs", "auto", "file-system path: auto, fuse or kernel")
	cmd.Flags().StringVar(&req.Policy, "policy", "", "checkpoint policy for auto turns: a built-in NAME or FILE.wasm")
	o.add(cmd)
	return cmd
}

func newExecCmd() *cobra.Command {
	var o clientOpts
	var req api.ExecRequest
	var stdin bool
	cmd := &cobra.Command{
		Use:   "exec NAME -- CMD...",
		Short: "Run a one-shot command in a sandbox; streams its output and returns its exit code",
		Example: "  rewind exec agent1 -- ls -la /\n  rewind exec agent1 --dir /work -- python3 -m pytest -q\n" +
			"  git diff | rewind exec agent1 -i -- git apply\n  rewind exec agent1 --json -- cat /work/a.bin   # {\"exit\",\"stdout\",\"stderr\"}",
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			for _, kv := range req.Env {
				if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
					return fmt.Errorf("--env %q: want K=V", kv)
				}
			}
			if stdin {
				// The API takes the input whole: read it to its end first.
				in, err := io.ReadAll(cmd.InOrStdin())
				if err != nil {
					return fmt.Errorf("read standard input: %w", err)
				}
				req.Stdin, req.StdinB64 = "", nil
				if utf8.Valid(in) {
					req.Stdin = string(in)
				} else {
					req.StdinB64 = in
				}
			}
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			req.Argv = args[1:]
			if !o.json {
				code, err := c.Exec(cmd.Context(), args[0], req, cmd.OutOrStdout(), cmd.ErrOrStderr())
				if err != nil {
					return err
				}
				if code != 0 {
					return exitError{code: code}
				}
				return nil
			}
			var stdout, stderr bytes.Buffer
			code, err := c.Exec(cmd.Context(), args[0], req, &stdout, &stderr)
			if err != nil {
				return err
			}
			res := execJSON{Exit: code}
			res.Stdout, res.StdoutB64 = textOrBytes(stdout.Bytes())
			res.Stderr, res.StderrB64 = textOrBytes(stderr.Bytes())
			if err := printJSON(cmd.OutOrStdout(), res); err != nil {
				return err
			}
			if code != 0 {
				return exitError{code: code}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&req.Dir, "dir", "", "working directory inside the sandbox")
	cmd.Flags().StringArrayVar(&req.Env, "env", nil, "environment variable K=V (repeatable)")
	cmd.Flags().Uint64Var(&req.Epoch, "epoch", 0, "fail if the sandbox was restored since this epoch")
	cmd.Flags().BoolVarP(&stdin, "stdin", "i", false, "send this command's standard input to the command (read to its end before the command starts)")
	o.add(cmd)
	return cmd
}

// execJSON is what exec --json prints once the command has ended. Output
// that is not valid UTF-8 comes as base64 in the _b64 field instead.
type execJSON struct {
	Exit      int    `json:"exit"`
	Stdout    string `json:"stdout"`
	Stderr    string `json:"stderr"`
	StdoutB64 []byte `json:"stdout_b64,omitempty"`
	StderrB64 []byte `json:"stderr_b64,omitempty"`
}

// textOrBytes returns b as text when it is valid UTF-8, else as bytes.
func textOrBytes(b []byte) (string, []byte) {
	if utf8.Valid(b) {
		return string(b), nil
	}
	return "", b
}

func newSessionCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "session",
		Short:   "Long-lived processes (bash, python) driven by the harness",
		Example: "  rewind session start agent1 --id sh -- bash\n  rewind session send agent1 sh 'cd /tmp && pwd'",
	}
	var o clientOpts
	var sreq api.SessionRequest
	start := &cobra.Command{
		Use:     "start NAME [--id S] -- CMD...",
		Short:   "Start a session process; prints its id",
		Example: "  rewind session start agent1 --id sh -- bash\n  rewind session start agent1 --id py -- python3 -i -q",
		Args:    cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			sreq.Argv = args[1:]
			id, err := c.StartSession(cmd.Context(), args[0], sreq)
			if err != nil {
				return err
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), map[string]string{"id": id})
			}
			fmt.Fprintln(cmd.OutOrStdout(), id)
			return nil
		},
	}
	start.Flags().StringVar(&sreq.ID, "id", "", "session id (default: generated)")
	start.Flags().StringArrayVar(&sreq.Env, "env", nil, "environment variable K=V (repeatable)")
	start.Flags().Uint64Var(&sreq.Epoch, "epoch", 0, "fail if the sandbox was restored since this epoch")
	o.add(start)

	var o2 clientOpts
	var sendReq api.SendRequest
	var idle, timeout time.Duration
	var turnMode string
	var turnDefer bool
	send := &cobra.Command{
		Use:   "send NAME S TEXT",
		Short: "Write TEXT and a newline to a session; print its answer until quiet (--idle) or --until matches",
		Long: `Write TEXT and a newline to a session and print its answer.

--restore CK first restores the sandbox to checkpoint CK, and --turn MODE ends the turn
once the answer is read: with both, the call is one tree-search step (back to a node, run
the next action, checkpoint the result) without the round trips between the three calls.
What the restore and the turn answered goes to stderr (or into the --json answer).`,
		Example: `  rewind session send agent1 sh 'export X=1; echo $X'
  rewind session send agent1 py 'print(6*7)' --until '>>> $'
  rewind session send agent1 sh 'make test' --restore ck-77aa01bb02cc --turn auto`,
		Args: cobra.ExactArgs(3),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o2.connect(cmd)
			if err != nil {
				return err
			}
			sendReq.Text = args[2]
			if sendReq.Until == "" || cmd.Flags().Changed("idle") {
				sendReq.IdleMS = int(idle.Milliseconds())
			}
			sendReq.TimeoutMS = int(timeout.Milliseconds())
			if cmd.Flags().Changed("turn") {
				if turnDefer && turnMode != "auto" {
					return fmt.Errorf("--defer needs --turn auto (a %s turn has nothing to decide)", turnMode)
				}
				sendReq.Turn = &api.TurnRequest{Mode: turnMode, Defer: turnDefer}
			} else if turnDefer {
				return fmt.Errorf("--defer needs --turn")
			}
			res, err := c.Step(cmd.Context(), args[0], args[1], sendReq)
			if err != nil {
				return err
			}
			if o2.json {
				if err := printJSON(cmd.OutOrStdout(), res); err != nil {
					return err
				}
				return sendEnded(nil, args[1], timeout, res)
			}
			fmt.Fprint(cmd.OutOrStdout(), res.Output)
			if r := res.Restore; r != nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "restored %s to %s (%s, epoch %d, %d us)\n", args[0], sendReq.Restore, r.Path, r.Epoch, r.ElapsedUS)
			}
			if t := res.Turn; t != nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "turn: %s %s (%s, %d us)\n", t.Decision, t.ID, t.Reason, t.ElapsedUS)
			}
			return sendEnded(cmd.ErrOrStderr(), args[1], timeout, res)
		},
	}
	send.Flags().DurationVar(&idle, "idle", 300*time.Millisecond, "return once the output has been quiet this long (with --until: only if given)")
	send.Flags().StringVar(&sendReq.Until, "until", "", "return once the output matches this regular expression")
	send.Flags().DurationVar(&timeout, "timeout", time.Minute, "give up after this long")
	send.Flags().Uint64Var(&sendReq.Epoch, "epoch", 0, "fail if the sandbox was restored since this epoch (with --restore: checked by the restore)")
	send.Flags().StringVar(&sendReq.Restore, "restore", "", "first restore the sandbox to this checkpoint")
	send.Flags().StringVar(&turnMode, "turn", "", "then end the turn in this mode (auto, skip, fs, full)")
	send.Flags().BoolVar(&turnDefer, "defer", false, "with --turn auto: answer with the checkpoint id at once and let the checkpoint decide")
	o2.add(send)

	var o3 clientOpts
	ls := &cobra.Command{
		Use:     "ls NAME",
		Short:   "List a sandbox's running sessions",
		Example: "  rewind session ls agent1",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o3.connect(cmd)
			if err != nil {
				return err
			}
			ids, err := c.Sessions(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if o3.json {
				return printJSON(cmd.OutOrStdout(), api.SessionList{Sessions: ids})
			}
			for _, id := range ids {
				fmt.Fprintln(cmd.OutOrStdout(), id)
			}
			return nil
		},
	}
	o3.add(ls)

	var o4 clientOpts
	var stopEpoch uint64
	stop := &cobra.Command{
		Use:     "stop NAME S",
		Short:   "Kill a session's process (and its process group) and forget the session",
		Example: "  rewind session stop agent1 server",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o4.connect(cmd)
			if err != nil {
				return err
			}
			return c.StopSession(cmd.Context(), args[0], args[1], stopEpoch)
		},
	}
	stop.Flags().Uint64Var(&stopEpoch, "epoch", 0, "fail if the sandbox was restored since this epoch")
	o4.add(stop)
	cmd.AddCommand(start, send, ls, stop)
	return cmd
}

// sendEnded is the outcome of a send whose read ended otherwise than by
// its --until or --idle: a timeout exits 124 (as timeout(1)), a session
// whose process exited exits with its status. It says so on w (nil: the
// --json answer says it).
func sendEnded(w io.Writer, session string, timeout time.Duration, res *api.SendResult) error {
	switch res.Ended {
	case state.EndedTimeout:
		if w != nil {
			fmt.Fprintf(w, "rewind: no complete answer within %v (--timeout): the process may still be busy; what it prints later comes with the next send\n", timeout)
		}
		return exitError{code: 124}
	case state.EndedExit:
		code := -1
		if res.Exit != nil {
			code = *res.Exit
		}
		if w != nil {
			fmt.Fprintf(w, "rewind: session %s exited (status %d)\n", session, code)
		}
		if code != 0 {
			return exitError{code: code}
		}
	}
	return nil
}

func printTurn(cmd *cobra.Command, o *clientOpts, r *api.TurnResult) error {
	if o.json {
		// The API's answer as it is: id, decision, reason, elapsed_us,
		// epoch, status, durable, and the effect report an auto turn
		// decided on.
		return printJSON(cmd.OutOrStdout(), r)
	}
	fmt.Fprintf(cmd.OutOrStdout(), "%s\t%s\t%s\t(%s)\n", r.ID, r.Decision, ms(r.ElapsedUS), r.Reason)
	return nil
}

// notDurable is the error of a turn or checkpoint called with --wait whose
// checkpoint did not become durable (nil when it did, or for a skip): the
// call promised to block until it was. The checkpoint exists and can be
// restored while this daemon runs; a crash would lose it.
func notDurable(ctx context.Context, c *client.Client, r *api.TurnResult) error {
	if r.Durable || r.Decision == state.ModeSkip {
		return nil
	}
	why := "the daemon's log says why"
	if ck, err := c.GetCheckpoint(ctx, r.ID); err == nil && ck.Error != "" {
		why = ck.Error
	}
	return fmt.Errorf("checkpoint %s is not durable (%s): it can be restored while this daemon runs, a crash would lose it", r.ID, why)
}

func newTurnCmd() *cobra.Command {
	var o clientOpts
	var req api.TurnRequest
	cmd := &cobra.Command{
		Use:   "turn NAME",
		Short: "End a turn: decide skip / fs / full and checkpoint asynchronously; prints the checkpoint id and decision",
		Long: `turn is the harness's one call after each tool call. It closes the effect-probe window,
asks the sandbox's policy (mode auto) or takes --mode, and starts the checkpoint in the
background: the call returns at once. Later operations on the sandbox wait for it; --wait
blocks until it is durable. A skip returns the previous checkpoint's id.`,
		Example: "  rewind turn agent1\n  rewind turn agent1 --mode fs --json\n  rewind turn agent1 --mode full --wait",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			r, err := c.Turn(cmd.Context(), args[0], req)
			if err != nil {
				return err
			}
			if err := printTurn(cmd, &o, r); err != nil {
				return err
			}
			if req.Wait {
				return notDurable(cmd.Context(), c, r)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&req.Mode, "mode", "auto", "auto, skip, fs or full")
	cmd.Flags().BoolVar(&req.Wait, "wait", false, "block until the checkpoint is durable")
	cmd.Flags().Uint64Var(&req.Epoch, "epoch", 0, "fail if the sandbox was restored since this epoch")
	o.add(cmd)
	return cmd
}

func newCheckpointCmd() *cobra.Command {
	var o clientOpts
	var wait bool
	var epoch uint64
	cmd := &cobra.Command{
		Use:     "checkpoint NAME",
		Short:   "Take a full checkpoint (= turn --mode full)",
		Example: "  rewind checkpoint agent1 --wait",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			r, err := c.Checkpoint(cmd.Context(), args[0], wait, epoch)
			if err != nil {
				return err
			}
			if err := printTurn(cmd, &o, r); err != nil {
				return err
			}
			if wait {
				return notDurable(cmd.Context(), c, r)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&wait, "wait", false, "block until the checkpoint is durable")
	cmd.Flags().Uint64Var(&epoch, "epoch", 0, "fail if the sandbox was restored since this epoch")
	o.add(cmd)
	return cmd
}

func newRestoreCmd() *cobra.Command {
	var o clientOpts
	var epoch uint64
	cmd := &cobra.Command{
		Use:     "restore NAME CKPT",
		Short:   "Bring a sandbox back to one of its checkpoints (files and processes, all or nothing)",
		Example: "  rewind restore agent1 ck-3f2a9b1c0d4e",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			r, err := c.Restore(cmd.Context(), args[0], args[1], epoch)
			if err != nil {
				return err
			}
			if o.json {
				// The API's answer: id, path, epoch, elapsed_us and the
				// daemon's phases (undo point included).
				return printJSON(cmd.OutOrStdout(), r)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "restored %s to %s via %s in %s (epoch %d)\n", args[0], r.ID, r.Path, ms(r.ElapsedUS), r.Epoch)
			return nil
		},
	}
	cmd.Flags().Uint64Var(&epoch, "epoch", 0, "fail if the sandbox was restored since this epoch")
	o.add(cmd)
	return cmd
}

func newForkCmd() *cobra.Command {
	var o clientOpts
	var req api.ForkRequest
	cmd := &cobra.Command{
		Use:   "fork CKPT --count N",
		Short: "Create N sandboxes from a checkpoint (each finds its copy number in /run/rewind/copy)",
		Example: `  rewind fork ck-3f2a9b1c0d4e --count 8 --prefix rollout-
  rewind fork ck-3f2a9b1c0d4e --count 32 --json
  rewind fork ck-3f2a9b1c0d4e --count 64 --prepare   # before the first training step`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			r, err := c.Fork(cmd.Context(), args[0], req)
			if err != nil {
				return err
			}
			if req.Prepare {
				if o.json {
					return printJSON(cmd.OutOrStdout(), map[string]any{"prepared": r.Prepared, "elapsed_us": r.ElapsedUS})
				}
				fmt.Fprintf(cmd.OutOrStdout(), "preparing %d fork children of %s in the background\n", r.Prepared, args[0])
				return nil
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), map[string]any{"sandboxes": r.Sandboxes, "elapsed_us": r.ElapsedUS})
			}
			for _, n := range r.Sandboxes {
				fmt.Fprintln(cmd.OutOrStdout(), n)
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "forked %d sandboxes in %s\n", len(r.Sandboxes), ms(r.ElapsedUS))
			return nil
		},
	}
	cmd.Flags().IntVar(&req.Count, "count", 1, "number of sandboxes")
	cmd.Flags().StringVar(&req.Prefix, "prefix", "", "name prefix, children numbered from 1 (default: the source sandbox's name and -, numbered on after earlier forks' children)")
	cmd.Flags().BoolVar(&req.NoWait, "no-wait", false, "fail instead of waiting when the checkpoint is not ready yet")
	cmd.Flags().BoolVar(&req.Prepare, "prepare", false, "make no sandboxes now: prepare --count children in the background, so later forks of CKPT only name them")
	o.add(cmd)
	return cmd
}

func newLsCmd() *cobra.Command {
	var o clientOpts
	cmd := &cobra.Command{
		Use:     "ls",
		Short:   "List sandboxes",
		Example: "  rewind ls\n  rewind ls --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			l, err := c.List(cmd.Context())
			if err != nil {
				return err
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), l)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSTATUS\tEPOCH\tTURNS\tHEAD\tORIGIN\tNOTE")
			for _, s := range l {
				fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\t%s\n", s.Name, s.Status, s.Epoch, s.Turns, dash(s.Head), dash(s.Origin), s.Note)
			}
			return tw.Flush()
		},
	}
	o.add(cmd)
	return cmd
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func newLogCmd() *cobra.Command {
	var o clientOpts
	cmd := &cobra.Command{
		Use:     "log NAME",
		Short:   "Show a sandbox's checkpoint tree with decisions and timings",
		Example: "  rewind log agent1\n  rewind log agent1 --json",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			l, err := c.Log(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), l)
			}
			printTree(cmd.OutOrStdout(), l)
			return nil
		},
	}
	o.add(cmd)
	return cmd
}

func newUsageCmd() *cobra.Command {
	var o clientOpts
	cmd := &cobra.Command{
		Use:   "usage NAME",
		Short: "Show what a sandbox's checkpoints hold on disk and in memory",
		Long: `Show what a sandbox's own checkpoints hold, measured now: their frozen fs
layers and written CRIU images on disk, and the template processes kept for
millisecond restores with their private dirty memory (the pages a template no
longer shares with the live processes).`,
		Example: "  rewind usage agent1\n  rewind usage agent1 --json",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			u, err := c.Usage(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), u)
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "checkpoints  %d\n", u.Checkpoints)
			fmt.Fprintf(w, "fs layers    %s (disk)\n", sizeStr(u.FSBytes))
			fmt.Fprintf(w, "images       %s (disk)\n", sizeStr(u.ProcBytes))
			fmt.Fprintf(w, "templates    %d, %s (memory)\n", u.Templates, sizeStr(u.TemplateBytes))
			return nil
		},
	}
	o.add(cmd)
	return cmd
}

// sizeStr prints n bytes in binary units.
func sizeStr(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// printTree prints the checkpoints as a tree, children under parents.
func printTree(w io.Writer, l *api.Log) {
	pinned := map[string]bool{}
	for _, p := range l.Pins {
		pinned[p] = true
	}
	in := map[string]*state.Checkpoint{}
	kids := map[string][]*state.Checkpoint{}
	for _, c := range l.Checkpoints {
		in[c.ID] = c
	}
	var roots []*state.Checkpoint
	for _, c := range l.Checkpoints {
		if in[c.Parent] != nil {
			kids[c.Parent] = append(kids[c.Parent], c)
		} else {
			roots = append(roots, c)
		}
	}
	fmt.Fprintf(w, "sandbox %s (%s, epoch %d, %d turns)\n", l.Sandbox.Name, l.Sandbox.Status, l.Sandbox.Epoch, l.Sandbox.Turns)
	var walk func(c *state.Checkpoint, prefix string, last bool)
	walk = func(c *state.Checkpoint, prefix string, last bool) {
		branch, next := "├─ ", "│  "
		if last {
			branch, next = "└─ ", "   "
		}
		var tags []string
		if c.ID == l.Sandbox.Head {
			tags = append(tags, "HEAD")
		}
		if pinned[c.ID] {
			tags = append(tags, "pinned")
		}
		if c.Sandbox != l.Sandbox.ID {
			tags = append(tags, "fork origin")
		}
		times := fmt.Sprintf("frozen %s, took %s", ms(c.FrozenUS), ms(c.TookUS))
		switch {
		case c.Status == state.CkptPending:
			// Still being taken: no times yet, and restorable once done
			// (a restore waits for it).
			times = "being taken"
			tags = append(tags, "pending")
		case !c.Restorable:
			tags = append(tags, "not restorable")
		case c.Durable:
			tags = append(tags, "durable")
		}
		fmt.Fprintf(w, "%s%s%s #%d %-4s %s  %s  [%s]\n", prefix, branch, c.ID, c.Seq, c.Decision,
			times, c.Reason, strings.Join(tags, ", "))
		ks := kids[c.ID]
		sort.Slice(ks, func(i, j int) bool { return ks[i].Seq < ks[j].Seq })
		for i, k := range ks {
			walk(k, prefix+next, i == len(ks)-1)
		}
	}
	for i, r := range roots {
		walk(r, "", i == len(roots)-1)
	}
}

func newRmCmd() *cobra.Command {
	var o clientOpts
	cmd := &cobra.Command{
		Use:     "rm NAME...",
		Short:   "Remove sandboxes (their checkpoints stay until GC; pinned ones stay usable by fork)",
		Example: "  rewind rm agent1 rollout-1 rollout-2",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			for _, n := range args {
				if err := c.Remove(cmd.Context(), n); err != nil {
					return err
				}
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), map[string]any{"removed": args})
			}
			return nil
		},
	}
	o.add(cmd)
	return cmd
}

func newPinCmd() *cobra.Command {
	return pinCmd("pin CKPT...", "Pin checkpoints: GC keeps them and all their ancestors",
		"  rewind pin ck-3f2a9b1c0d4e ck-77aa01bb02cc", (*client.Client).Pin)
}

func newUnpinCmd() *cobra.Command {
	return pinCmd("unpin CKPT...", "Unpin checkpoints (GC may then free them if nothing else reaches them)",
		"  rewind unpin ck-3f2a9b1c0d4e", (*client.Client).Unpin)
}

// pinCmd builds pin and unpin: both take checkpoint ids and print the pins.
func pinCmd(use, short, example string, call func(*client.Client, context.Context, []string) ([]string, error)) *cobra.Command {
	var o clientOpts
	cmd := &cobra.Command{
		Use:     use,
		Short:   short,
		Example: example,
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			pins, err := call(c, cmd.Context(), args)
			if err != nil {
				return err
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), map[string]any{"pins": pins})
			}
			return nil
		},
	}
	o.add(cmd)
	return cmd
}

func newGCCmd() *cobra.Command {
	var o clientOpts
	var dry bool
	cmd := &cobra.Command{
		Use:     "gc",
		Short:   "Free checkpoints unreachable from pins and live sandboxes",
		Example: "  rewind gc --dry-run\n  rewind gc --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			r, err := c.GC(cmd.Context(), dry)
			if err != nil {
				return err
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), r)
			}
			verb := "freed"
			if dry {
				verb = "would free"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s %d checkpoints (%d bytes), kept %d\n", verb, len(r.Freed), r.Bytes, r.Kept)
			for _, e := range r.Errors {
				fmt.Fprintln(cmd.ErrOrStderr(), "error:", e)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&dry, "dry-run", false, "list what would be freed, free nothing")
	o.add(cmd)
	return cmd
}

func newDaemonCmd() *cobra.Command {
	var cfg daemon.Config
	var level, memoryMax string
	cmd := &cobra.Command{
		Use:   "daemon",
		Short: "Run the rewind daemon (HTTP/JSON API on a root-only unix socket)",
		Example: `  rewind daemon
  rewind daemon --state /tmp/rw --socket /tmp/rw/rewind.sock --max-checkpoints 5000`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var lv slog.Level
			if err := lv.UnmarshalText([]byte(level)); err != nil {
				return fmt.Errorf("--log-level: %w", err)
			}
			cfg.Logger = slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: lv}))
			cfg.Version = version
			if cfg.Socket == "" {
				cfg.Socket = client.SocketFromEnv()
			}
			if cfg.StateDir == "" {
				cfg.StateDir = stateDirFromEnv()
			}
			if memoryMax != "" {
				n, err := parseSize(memoryMax)
				if err != nil || n < 16<<20 {
					return fmt.Errorf("--memory-max %q: want a size of at least 16M (bytes, or with K/M/G/T)", memoryMax)
				}
				cfg.MemoryMax = n
			}
			if cfg.PidsMax < 0 {
				return fmt.Errorf("--pids-max %d: want 0 (the default) or more", cfg.PidsMax)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return daemon.Run(ctx, cfg)
		},
	}
	cmd.Flags().StringVar(&cfg.StateDir, "state", "", "state directory (default $REWIND_STATE or "+api.DefaultStateDir+")")
	cmd.Flags().StringVar(&cfg.Socket, "socket", "", "API socket (default $REWIND_SOCKET or "+api.DefaultSocket+")")
	cmd.Flags().StringVar(&cfg.Backend, "backend", "real", "real, or fake (in-memory, no root needed: for tests)")
	cmd.Flags().StringVar(&cfg.DefaultPolicy, "policy", "effects", "policy of sandboxes created without --policy")
	cmd.Flags().IntVar(&cfg.Budget.MaxCheckpoints, "max-checkpoints", 0, "run GC automatically above this many checkpoints (0: never)")
	cmd.Flags().Int64Var(&cfg.Budget.MaxBytes, "max-bytes", 0, "run GC automatically above this many checkpoint bytes (0: never)")
	cmd.Flags().IntVar(&cfg.MaxTemplates, "max-templates", 0, "checkpoints that keep live process templates (0: 256); older ones restore from their CRIU image")
	cmd.Flags().Int64Var(&cfg.MaxTemplateBytes, "max-template-bytes", 0, "private memory all templates may hold (0: 4 GiB)")
	cmd.Flags().BoolVar(&cfg.NoHugePages, "no-huge-pages", false, "keep checkpointed process memory in 4 KiB pages (by default it is collapsed into huge pages in the background, so forks and restores do not grow with memory size)")
	cmd.Flags().IntVar(&cfg.CompactDepth, "compact-depth", daemon.DefaultCompactDepth, "merge a sandbox's frozen layers in the background once its stack is this deep (-1: never)")
	cmd.Flags().IntVar(&cfg.WarmForks, "warm-forks", 64, "fork children to prepare ahead of a repeated fork of a checkpoint (0: none)")
	cmd.Flags().StringVar(&memoryMax, "memory-max", "", "memory each sandbox may use, page cache and swap included (bytes, or with K/M/G/T; default unbounded); past it the kernel kills a process inside the sandbox")
	cmd.Flags().IntVar(&cfg.PidsMax, "pids-max", 0, "tasks (processes and threads) each sandbox may have (0: 8192)")
	cmd.Flags().IntVar(&cfg.SpareInits, "spare-inits", 2, "sandbox inits to keep started ahead, so that a new sandbox or fork child skips the init's start (0: none)")
	cmd.Flags().StringVar(&cfg.InitPath, "init", "", "binary every sandbox runs as its init (default: "+daemon.InitName+" beside this binary when it is from the same build, else this binary)")
	cmd.Flags().StringVar(&cfg.StoreConfig, "store-config", "", "store config written by rewind init-store, whose image is mounted on the state dir at start (default "+kernelpath.DefaultStoreConfig+")")
	cmd.Flags().StringVar(&level, "log-level", "info", "debug, info, warn or error")
	return cmd
}
