package bench

import (
	"fmt"
	"strings"
)

// JudgeFanout returns the fan-out targets' verdicts on rows: each rewind
// row at 64 copies ready within 250 ms and a trainer waiting at most 5%
// of the time. Without rows at 64 copies it returns none.
func JudgeFanout(rows []FanoutRow) []Verdict {
	floor := ""
	for _, r := range rows {
		if r.Name == floorName && r.N == targetForks && r.Error == "" {
			floor = fmt.Sprintf("shell floor %.0f ms: %d shells already running, nothing forked", r.ReadyMS, targetForks)
		}
	}
	var out []Verdict
	for _, r := range rows {
		if r.N != targetForks || r.Error != "" || !strings.HasPrefix(r.Name, "rewind-") {
			continue
		}
		out = append(out,
			verdict(fmt.Sprintf("%s: %d copies ready within %d ms", r.Name, targetForks, maxFanoutMS), r.ReadyMS, maxFanoutMS, true, "ms", floor),
			verdict(fmt.Sprintf("%s at %d copies: trainer waits <= %.0f%%", r.Name, targetForks, 100*maxWaitFanout), 100*r.TrainerWait, 100*maxWaitFanout, true, "%", ""))
	}
	return out
}
