package stream

import (
	"strings"
	"testing"
)

func TestHeaderValue(t *testing.T) {
	got := headerValue("line one\r\nline two\x00\xff" + strings.Repeat("é", 1000))
	if strings.ContainsAny(got, "\r\n\x00") || len(got) > maxHeaderError || !strings.HasPrefix(got, "line one  line two \uFFFD") {
		t.Errorf("headerValue = %q", got[:40])
	}
	if !strings.HasSuffix(got, "é") {
		t.Errorf("headerValue cut a rune: %q", got[len(got)-4:])
	}
}
