package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
)

// TestExecCmd: `rewind exec -i` hands the CLI's standard input to the
// command (binary input too), without -i the command reads nothing, and
// --json prints the exit status and both outputs, non-UTF-8 output in
// base64, with the command's exit status kept.
func TestExecCmd(t *testing.T) {
	c, sock := startRealDaemonAt(t)
	if _, err := c.Create(context.Background(), api.CreateRequest{Name: "x"}); err != nil {
		t.Fatal(err)
	}
	run := func(stdin []byte, args ...string) ([]byte, error) {
		t.Helper()
		cmd := newExecCmd()
		cmd.SilenceErrors, cmd.SilenceUsage = true, true // as under the root command
		var out bytes.Buffer
		cmd.SetIn(bytes.NewReader(stdin))
		cmd.SetOut(&out)
		cmd.SetErr(&out)
		cmd.SetArgs(append([]string{"--socket", sock}, args...))
		err := cmd.ExecuteContext(context.Background())
		return out.Bytes(), err
	}
	bin := []byte{0xff, 0x00, 'h', 'i', 0xfe, '\n'}
	if out, err := run(bin, "-i", "x", "--", "cat"); err != nil || !bytes.Equal(out, bin) {
		t.Fatalf("exec -i cat: %q %v, want %q", out, err, bin)
	}
	if out, err := run([]byte("ignored\n"), "x", "--", "cat"); err != nil || len(out) != 0 {
		t.Fatalf("exec cat without -i: %q %v, want no output", out, err)
	}
	out, err := run(nil, "--json", "x", "--", "sh", "-c", `echo text; printf '\377' >&2; exit 3`)
	var ee exitError
	if !errors.As(err, &ee) || ee.code != 3 {
		t.Fatalf("exec --json of a command exiting 3: %v", err)
	}
	var res struct {
		Exit      int    `json:"exit"`
		Stdout    string `json:"stdout"`
		Stderr    string `json:"stderr"`
		StderrB64 []byte `json:"stderr_b64"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("exec --json printed %q: %v", out, err)
	}
	if res.Exit != 3 || res.Stdout != "text\n" || res.Stderr != "" || !bytes.Equal(res.StderrB64, []byte{0xff}) {
		t.Fatalf("exec --json: %+v", res)
	}
	if _, err := run(nil, "--env", "NOEQUALS", "x", "--", "true"); err == nil {
		t.Fatal("--env without = accepted")
	}
}
