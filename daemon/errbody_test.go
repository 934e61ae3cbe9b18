package daemon

import (
	"context"
	"fmt"
	"testing"

	"github.com/rewind-sandbox/rewind/state"
)

// TestErrBodyCodes: a call cut short answers conflict, unless its error
// carries a code of its own (a policy whose start function ran out of
// time is a bad request, as every other policy that cannot load).
func TestErrBodyCodes(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{context.Canceled, state.CodeConflict},
		{fmt.Errorf("exec: %w", context.DeadlineExceeded), state.CodeConflict},
		{&state.Error{Code: state.CodeBadRequest, Msg: "policy x", Err: fmt.Errorf("start: %w", context.DeadlineExceeded)}, state.CodeBadRequest},
		{fmt.Errorf("create: %w", &state.Error{Code: state.CodeNotFound, Msg: "y", Err: context.Canceled}), state.CodeNotFound},
		{fmt.Errorf("plain"), state.CodeInternal},
	} {
		if got := errBody(tc.err).Code; got != tc.want {
			t.Errorf("%v: code %s, want %s", tc.err, got, tc.want)
		}
	}
}
