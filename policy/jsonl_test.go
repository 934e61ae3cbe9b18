package policy

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestModeText(t *testing.T) {
	for _, m := range []Mode{Skip, FS, Full} {
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		var back Mode
		if err := json.Unmarshal(b, &back); err != nil || back != m {
			t.Fatalf("%v -> %s -> %v, %v", m, b, back, err)
		}
	}
	if m, err := ParseMode("fs-only"); err != nil || m != FS {
		t.Fatalf("fs-only: %v %v", m, err)
	}
	if _, err := ParseMode("maybe"); err == nil {
		t.Fatal("maybe accepted")
	}
	if Mode(9).String() != "mode(9)" || Mode(0) != Full {
		t.Fatal("zero value must be Full")
	}
}

func TestReadJSONL(t *testing.T) {
	reports, err := ReadReports(strings.NewReader(`{"turn":1,"fs":{"modified":2}}

{"turn":2,"lost_events":1}
`))
	if err != nil || len(reports) != 2 || reports[0].FS.Modified != 2 || reports[1].LostEvents != 1 {
		t.Fatalf("%+v, %v", reports, err)
	}
	if _, err := ReadReports(strings.NewReader("{\"turn\":1}\n{oops\n")); err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Fatalf("bad line: %v", err)
	}
	exps, err := ReadExpectations(strings.NewReader(`{"turn":1,"mode":"skip","reason":"no effects"}` + "\n" + `{"turn":2,"mode":"full"}`))
	if err != nil || len(exps) != 2 || exps[0].Mode != Skip || exps[0].Reason != "no effects" || exps[1].Mode != Full {
		t.Fatalf("%+v, %v", exps, err)
	}
	if _, err := ReadExpectations(strings.NewReader(`{"turn":1,"mode":"sometimes"}`)); err == nil {
		t.Fatal("unknown mode accepted")
	}
}
