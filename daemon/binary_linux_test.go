package daemon_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
)

// TestRealBinaryIO: bytes that are not UTF-8 text reach a command's
// standard input (stdin_b64) and come back from its standard output and
// error, and from a session, exactly; JSON text alone replaced them with
// U+FFFD.
func TestRealBinaryIO(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "b"}); err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, 200_000) // several pipe reads: chunks split characters
	for i := range data {
		data[i] = byte(r.IntN(256))
	}
	exec := func(req api.ExecRequest) (stdout, stderr []byte) {
		t.Helper()
		var o, e bytes.Buffer
		code, err := c.Exec(ctx, "b", req, &o, &e)
		if err != nil || code != 0 {
			t.Fatalf("exec %v: code %d err %v stderr %q", req.Argv, code, err, e.String())
		}
		return o.Bytes(), e.Bytes()
	}
	exec(api.ExecRequest{Argv: []string{"sh", "-c", "cat > /tmp/rnd"}, StdinB64: data})
	if out, _ := exec(api.ExecRequest{Argv: []string{"cat", "/tmp/rnd"}}); !bytes.Equal(out, data) {
		t.Fatalf("stdout: %d bytes back, want the %d written (equal: %v)", len(out), len(data), bytes.Equal(out, data))
	}
	if _, errOut := exec(api.ExecRequest{Argv: []string{"sh", "-c", "cat /tmp/rnd >&2"}}); !bytes.Equal(errOut, data) {
		t.Fatalf("stderr: %d bytes back, want the %d written", len(errOut), len(data))
	}
	want := []byte{0xff, 0xfe, 0x00, 0x01, 'A', 'B', 'C'}
	if out, _ := exec(api.ExecRequest{Argv: []string{"printf", `\377\376\000\001ABC`}}); !bytes.Equal(out, want) {
		t.Fatalf("printf: %q, want %q", out, want)
	}
	// Text input still goes as text.
	if out, _ := exec(api.ExecRequest{Argv: []string{"cat"}, Stdin: "héllo\n"}); string(out) != "héllo\n" {
		t.Fatalf("text stdin: %q", out)
	}
	var apiErr *client.Error
	if _, err := c.Exec(ctx, "b", api.ExecRequest{Argv: []string{"cat"}, Stdin: "a", StdinB64: []byte("b")}, nil, nil); !errors.As(err, &apiErr) || apiErr.Code != "bad_request" {
		t.Fatalf("stdin and stdin_b64 both set: %v, want a bad request", err)
	}
	if _, err := c.StartSession(ctx, "b", api.SessionRequest{ID: "sh", Argv: []string{"sh"}}); err != nil {
		t.Fatal(err)
	}
	res, err := c.Step(ctx, "b", "sh", api.SendRequest{Text: `printf '\377\376ok'; echo @@done@@`, Until: "@@done@@", TimeoutMS: 30000})
	if err != nil {
		t.Fatal(err)
	}
	if want := "\xff\xfeok@@done@@\n"; res.Output != want || string(res.OutputB64) != want {
		t.Fatalf("session output %q (base64 %q), want %q in both", res.Output, res.OutputB64, want)
	}
}
