package bench

import (
	"path"
	"regexp"
	"strings"
	"sync"
)

// shellState is the part of the persistent shell's state the crash check
// expects a recovery to bring back: the cwd relative to $R and the
// AGENT_STEP variable. It is a model of the trace's commands, the same for
// every kind of node; the package comment says exactly what it models.
type shellState struct {
	cwd, step string
	// old is the cwd before the last cd (bash's OLDPWD, relative to $R),
	// which cd - returns to; oldSet says a cd has set it.
	old    string
	oldSet bool
}

// next applies a node's commands to the expected shell state.
func (s shellState) next(n Node) shellState { return s.run(n.Commands) }

// run applies commands, in order.
func (s shellState) run(cmds []string) shellState {
	for _, c := range cmds {
		for _, p := range shellPieces(c) {
			s = s.apply(p)
		}
	}
	return s
}

// piece is one top-level part of a command line and the control operator
// that ends it ("" at the end of the line; a newline counts as ";").
type piece struct{ text, op string }

// shellPieces returns the simple commands of a command line that the shell
// runs itself, in order, assuming every command succeeds: it leaves out
// lists sent to the background, members of pipelines, subshells and what
// follows ||.
func shellPieces(line string) []string {
	var out, list []string // list: the pieces of the current list that run
	prev := ""             // the operator before the piece
	for _, p := range splitTopLevel(line) {
		inPipe := prev == "|" || prev == "|&" || p.op == "|" || p.op == "|&"
		text := strings.TrimSpace(p.text)
		if !inPipe && prev != "||" && text != "" && !strings.HasPrefix(text, "(") {
			list = append(list, text)
		}
		prev = p.op
		if p.op == "&&" || p.op == "||" || p.op == "|" || p.op == "|&" {
			continue
		}
		// The list ends here: run it unless it went to the background.
		if p.op != "&" {
			out = append(out, list...)
		}
		list, prev = list[:0], ""
	}
	return out
}

// splitTopLevel cuts line at its control operators outside quotes,
// parentheses, command substitutions and comments.
func splitTopLevel(s string) []piece {
	var out []piece
	start := 0
	for i := 0; i < len(s); i++ {
		op := ""
		next := byte(0)
		if i+1 < len(s) {
			next = s[i+1]
		}
		switch s[i] {
		case '\n':
			op = ";"
		case ';':
			op = ";"
			if next == ';' {
				op = ";;"
			}
		case '&':
			switch {
			case next == '&':
				op = "&&"
			case next == '>' || (i > 0 && (s[i-1] == '>' || s[i-1] == '<')):
				// &> and >&, <&: a redirection.
			default:
				op = "&"
			}
		case '|':
			switch {
			case i > 0 && s[i-1] == '>':
				// >|: a redirection.
			case next == '|':
				op = "||"
			case next == '&':
				op = "|&"
			default:
				op = "|"
			}
		default:
			i = skipConstruct(s, i)
			continue
		}
		if op == "" {
			continue
		}
		out = append(out, piece{s[start:i], op})
		i += len(op) - 1
		start = i + 1
	}
	return append(out, piece{s[start:], ""})
}

// skipConstruct returns the index of the last byte of the construct that
// starts at s[i] in command context: a quoted string, a backslash escape,
// a parenthesized list (subshell, $( ) or $(( ))), a backquoted command or
// a comment (up to its newline); i itself for any other byte.
func skipConstruct(s string, i int) int {
	switch s[i] {
	case '\\':
		return min(i+1, len(s)-1)
	case '\'':
		if j := strings.IndexByte(s[i+1:], '\''); j >= 0 {
			return i + 1 + j
		}
		return len(s) - 1
	case '"':
		return skipTo(s, i+1, '"')
	case '`':
		return skipTo(s, i+1, '`')
	case '(':
		return skipTo(s, i+1, ')')
	case '#':
		if i == 0 || strings.IndexByte(" \t\n;&|()<>", s[i-1]) >= 0 {
			if j := strings.IndexByte(s[i:], '\n'); j >= 0 {
				return i + j - 1
			}
			return len(s) - 1
		}
	}
	return i
}

// skipTo returns the index of the byte close that ends the construct whose
// contents start at s[i] (len(s)-1 when it is unterminated): '"' a double
// quoted string, '`' a backquoted command, ')' a parenthesized list.
func skipTo(s string, i int, close byte) int {
	for ; i < len(s); i++ {
		c := s[i]
		if c == close {
			return i
		}
		switch close {
		case '"':
			switch {
			case c == '\\':
				i++
			case c == '$' && i+1 < len(s) && s[i+1] == '(':
				i = skipTo(s, i+2, ')')
			case c == '`':
				i = skipTo(s, i+1, '`')
			}
		case '`':
			if c == '\\' {
				i++
			}
		default:
			i = skipConstruct(s, i)
		}
	}
	return len(s) - 1
}

// redirRE matches a redirection word: an operator, with its target in
// the word (>/dev/null) or not (the next word is: > /dev/null).
var redirRE = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^[0-9]*(>>|>&|>\||<>|<&|>|<|&>>|&>)(.*)$`)
})

// onlyRedirections reports whether words are all redirections.
func onlyRedirections(words []string) bool {
	for i := 0; i < len(words); i++ {
		m := redirRE().FindStringSubmatch(words[i])
		if m == nil {
			return false
		}
		if m[2] == "" {
			if i+1 == len(words) {
				return false
			}
			i++
		}
	}
	return true
}

// plainValue returns a word's value when it is a plain string: unquoted,
// or quoted whole, with no expansion or escape in it.
func plainValue(w string) (string, bool) {
	if len(w) >= 2 && (w[0] == '\'' || w[0] == '"') && w[len(w)-1] == w[0] {
		w = w[1 : len(w)-1]
		return w, !strings.ContainsAny(w, "$`\\'\"")
	}
	return w, !strings.ContainsAny(w, "$`\\'\"*?[~{}()<>|&;")
}

// apply applies one simple command (a piece shellPieces kept).
func (s shellState) apply(cmd string) shellState {
	w := strings.Fields(cmd)
	for i, x := range w {
		if strings.HasPrefix(x, "#") {
			w = w[:i] // a comment
			break
		}
	}
	if len(w) == 0 {
		return s
	}
	switch {
	case w[0] == "cd" && len(w) >= 2 && onlyRedirections(w[2:]):
		if w[1] == "-" {
			if s.oldSet {
				s.cwd, s.old = s.old, s.cwd
			}
			return s
		}
		if dir, ok := underR(w[1]); ok {
			s.cwd, s.old, s.oldSet = dir, s.cwd, true
		}
	case w[0] == "export" || len(w) == 1 && strings.HasPrefix(w[0], "AGENT_STEP="):
		args := w
		if w[0] == "export" {
			args = w[1:]
		}
		for _, a := range args {
			if v, ok := strings.CutPrefix(a, "AGENT_STEP="); ok {
				if v, ok := plainValue(v); ok {
					s.step = v
				}
			}
		}
	case w[0] == "unset" && len(w) == 2 && w[1] == "AGENT_STEP":
		s.step = ""
	}
	return s
}

// underR returns the cwd relative to $R that cd ARG leads to, when ARG is
// $R or $R/PATH as the package comment says.
func underR(arg string) (string, bool) {
	if len(arg) >= 2 && arg[0] == '"' && arg[len(arg)-1] == '"' {
		arg = arg[1 : len(arg)-1]
	}
	rest, ok := strings.CutPrefix(arg, "${R}")
	if !ok {
		if rest, ok = strings.CutPrefix(arg, "$R"); !ok {
			return "", false
		}
	}
	if rest != "" && rest[0] != '/' || strings.ContainsAny(rest, "$`\\'\"*?[~{}") {
		return "", false
	}
	rel := path.Clean("." + rest)
	switch {
	case rel == ".":
		return "", true
	case rel == ".." || strings.HasPrefix(rel, "../"):
		return "", false
	}
	return "/" + rel, true
}

func (s shellState) suffix() string { return " cwd=" + s.cwd + " step=" + s.step }
