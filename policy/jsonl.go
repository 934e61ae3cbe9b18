package policy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"

	"github.com/rewind-sandbox/rewind/effect"
)

// maxJSONLLine bounds one line of a JSONL file (a report with every sample
// filled in is far smaller).
const maxJSONLLine = 4 << 20

// ReadReports reads effect reports, one JSON object per line (blank lines
// are ignored), as written by `rewind policy record`.
func ReadReports(r io.Reader) ([]effect.Report, error) {
	var out []effect.Report
	err := eachLine(r, func(n int, line []byte) error {
		// A line may carry a "note" (free text, ignored) besides the
		// report's own fields.
		var rep struct {
			effect.Report
			Note string `json:"note,omitempty"`
		}
		if err := strictJSON(line, &rep); err != nil {
			return fmt.Errorf("line %d: %w", n, err)
		}
		if rep.Turn == 0 {
			return fmt.Errorf("line %d: no \"turn\" (is it an effect report?)", n)
		}
		out = append(out, rep.Report)
		return nil
	})
	return out, err
}

// Expectation is one line of an expectations file: the decision expected
// for the report with the same turn.
type Expectation struct {
	Turn uint64 `json:"turn"`
	Mode Mode   `json:"mode"`
	// Reason, when not empty, must equal the decision's reason.
	Reason string `json:"reason,omitempty"`
	// Note is free text for the reader (ignored).
	Note string `json:"note,omitempty"`
}

// ReadExpectations reads expectations, one JSON object per line.
func ReadExpectations(r io.Reader) ([]Expectation, error) {
	var out []Expectation
	err := eachLine(r, func(n int, line []byte) error {
		var e Expectation
		if err := strictJSON(line, &e); err != nil {
			return fmt.Errorf("line %d: %w", n, err)
		}
		out = append(out, e)
		return nil
	})
	return out, err
}

func eachLine(r io.Reader, fn func(n int, line []byte) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxJSONLLine)
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		if err := fn(n, line); err != nil {
			return err
		}
	}
	return sc.Err()
}

// strictJSON decodes one JSON object into v, refusing fields v does not
// have (a typo, or a line that is no report at all, was read as an empty
// report and decided) and anything after the object.
func strictJSON(line []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return fmt.Errorf("more than one JSON value on the line")
	}
	return nil
}
