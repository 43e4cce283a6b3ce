package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"quotaflow/internal/llmtest"
)

// The zero-code path: admission's LLM gateway mode (QF_GATEWAY_*) in front
// of a stand-in OpenAI-compatible LLM (llmtest), called as any OpenAI
// client would, its usage checked in the ledger.

// llmCall is one call of the demo's gateway mix: the request's maximum and
// the completion the stand-in then reports (less, as real answers are).
type llmCall struct {
	stream     bool
	maxTokens  int
	completion int64
}

// llmMix: streamed and not, short and long answers under their maxima.
var llmMix = []llmCall{
	{false, 128, 60}, {true, 128, 110}, {false, 256, 90}, {true, 256, 200},
	{false, 512, 300}, {true, 512, 140}, {false, 1024, 450}, {true, 1024, 700},
}

// llmPrompt is the tokens the stand-in reports for every call's input.
const llmPrompt = 24

// GatewayReport is what the gateway mix did and what the ledger holds of it.
type GatewayReport struct {
	Calls, OK    int
	Used         int64 // the stand-in's reported usage (input + output) of the calls answered
	Ledger       [2]int64
	Reserved     int64 // the ledger's estimates of the calls' reservations
	SettledUsage int64 // the ledger's actual tokens of those reservations
	Err          error // a call that failed, or a ledger unreadable
}

// Matches reports whether the ledger holds exactly one actual event per
// answered call and the stand-in's usage.
func (g *GatewayReport) Matches() bool {
	return g.Err == nil && g.Ledger == [2]int64{int64(g.OK), g.Used} && g.OK == g.Calls
}

// playGateway sends llmMix through the gateway at base as key.
func playGateway(ctx context.Context, up *llmtest.Upstream, base, key string) *GatewayReport {
	rep := &GatewayReport{Calls: len(llmMix)}
	client := &http.Client{Timeout: 30 * time.Second}
	for _, c := range llmMix {
		up.Set(llmtest.Behaviour{Words: words(c.completion), PromptTokens: llmPrompt, CompletionTokens: c.completion})
		body, _ := json.Marshal(map[string]any{"model": "gpt-4o", "max_tokens": c.maxTokens, "stream": c.stream,
			"messages": []map[string]string{{"role": "user", "content": "Write a short note about quotas for LLM APIs."}}})
		req, err := http.NewRequestWithContext(ctx, "POST", base+"/v1/chat/completions", strings.NewReader(string(body)))
		if err != nil {
			rep.Err = err
			return rep
		}
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			rep.Err = fmt.Errorf("gateway call: %w", err)
			return rep
		}
		text, err := answerText(resp.Body, c.stream)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || err != nil || text != strings.Repeat(" hello", int(c.completion)) {
			rep.Err = fmt.Errorf("gateway call (stream %v, max_tokens %d) = %d, %v: a %d-byte answer", c.stream, c.maxTokens, resp.StatusCode, err, len(text))
			return rep
		}
		rep.OK++
		rep.Used += llmPrompt + c.completion
	}
	return rep
}

// words is n one-token words: the stand-in's text matching its usage.
func words(n int64) []string {
	w := make([]string, n)
	for i := range w {
		w[i] = " hello"
	}
	return w
}

// answerText reads a chat completion's text, streamed or not.
func answerText(r io.Reader, stream bool) (string, error) {
	if !stream {
		var a struct {
			Choices []struct{ Message struct{ Content string } }
		}
		if err := json.NewDecoder(r).Decode(&a); err != nil || len(a.Choices) != 1 {
			return "", fmt.Errorf("answer: %v", err)
		}
		return a.Choices[0].Message.Content, nil
	}
	var text strings.Builder
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c struct {
			Choices []struct{ Delta struct{ Content string } }
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return "", err
		}
		for _, ch := range c.Choices {
			text.WriteString(ch.Delta.Content)
		}
	}
	return text.String(), sc.Err()
}

// readGatewayLedger fills in what the ledger holds of tenant's calls (read
// once the pipeline is empty): actual events and tokens, and the
// reservations' estimates beside their actual tokens.
func readGatewayLedger(ctx context.Context, rep *GatewayReport, dbURL, tenant string) {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		rep.Err = fmt.Errorf("ledger: %w", err)
		return
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, `SELECT count(actual_tokens), coalesce(sum(actual_tokens), 0)::bigint FROM reservations
WHERE tenant = $1`, tenant).Scan(&rep.Ledger[0], &rep.Ledger[1]); err != nil {
		rep.Err = fmt.Errorf("ledger: %w", err)
		return
	}
	if err := conn.QueryRow(ctx, `SELECT coalesce(sum(estimated_tokens), 0)::bigint, coalesce(sum(actual_tokens), 0)::bigint
FROM reservations WHERE tenant = $1`, tenant).Scan(&rep.Reserved, &rep.SettledUsage); err != nil {
		rep.Err = fmt.Errorf("ledger: %w", err)
	}
}

// Overreservation is the reservations' estimates ÷ their actual usage
// (0 when nothing settled): how much quota a call holds while it runs.
func (g *GatewayReport) Overreservation() float64 {
	if g.SettledUsage == 0 {
		return 0
	}
	return float64(g.Reserved) / float64(g.SettledUsage)
}

func (g *GatewayReport) String() string {
	s := fmt.Sprintf("%d/%d calls answered, stand-in usage %d tokens; ledger %d actual events, %d tokens",
		g.OK, g.Calls, g.Used, g.Ledger[0], g.Ledger[1])
	if g.Err != nil {
		s += "; " + g.Err.Error()
	}
	return s
}
