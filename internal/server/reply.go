package server

import (
	"encoding/json"
	"net/http"
)

// JSON answers body as JSON with status; the read APIs' answers are never
// cached (they are per token).
func JSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

// Problem answers an RFC 9457 problem of status saying detail.
func Problem(w http.ResponseWriter, status int, detail string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(ProblemBody{http.StatusText(status), status, detail})
}

// ProblemBody is the body Problem writes, for clients that read it.
type ProblemBody struct {
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
}
