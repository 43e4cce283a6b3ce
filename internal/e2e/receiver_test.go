package e2e

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"net/http"
	"strconv"
	"testing"
	"time"
)

// TestReceiverVerify checks the signature check against a signature made
// here by the spec's recipe, and that tampering is refused.
func TestReceiverVerify(t *testing.T) {
	key := []byte("0123456789abcdef0123")
	secret := "whsec_" + base64.StdEncoding.EncodeToString(key)
	r, err := NewReceiver(secret, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	body := []byte(`{"type":"quota.threshold","data":{}}`)
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	m := hmac.New(sha256.New, key)
	m.Write([]byte("msg_1." + ts + "."))
	m.Write(body)
	sig := "v1," + base64.StdEncoding.EncodeToString(m.Sum(nil))
	h := http.Header{}
	h.Set("webhook-id", "msg_1")
	h.Set("webhook-timestamp", ts)
	h.Set("webhook-signature", "v1,AAAA "+sig) // a rotated-out signature first
	if err := r.Verify(h, body); err != nil {
		t.Errorf("valid signature refused: %v", err)
	}
	if err := r.Verify(h, append(body, ' ')); err == nil {
		t.Error("tampered body accepted")
	}
	h.Set("webhook-timestamp", strconv.FormatInt(time.Now().Add(-time.Hour).Unix(), 10))
	if err := r.Verify(h, body); err == nil {
		t.Error("stale timestamp accepted")
	}
}
