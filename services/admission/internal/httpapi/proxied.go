package httpapi

import (
	"context"
	"encoding/json"
	"net/http"
	"time"

	"quotaflow/pkg/events"
	"quotaflow/services/admission/internal/decide"
)

// This file is what the LLM gateway mode (package llmproxy) asks of the
// API for each request it proxies: the decision of POST /v1/admit, the
// release of POST /v1/release and the report of POST /v1/usage, by the same
// code, so that a proxied request is limited, released and charged exactly
// as one a gateway admits through the API.

// Admission is the decision on a proxied request.
type Admission struct {
	// Status is what POST /v1/admit would answer: 200 allowed, 429 denied,
	// 400 (Message says what is invalid), 499 (the client left).
	Status int
	// RequestID is the id of the reservation (minted here, as POST
	// /v1/admit mints one for a request without).
	RequestID string
	// Header holds POST /v1/admit's rate-limit headers and, on a denial
	// that waiting cures, Retry-After.
	Header http.Header
	// Reason is a denial's reason (limits.Reason), "" for a plain one.
	Reason string
	// Message says why a request was denied or not decided.
	Message string
}

// routeLLM labels the gateway's admissions in the failopen counter.
const routeLLM = "llm"

// AdmitTokens decides on a proxied request of input and at most output
// tokens of in.Model for in.Tenant and in.User, weighed by the policy's
// model weights as POST /v1/admit weighs input_tokens and max_output_tokens,
// and publishes the decision's event. in.RequestID must be empty.
func (h *Handler) AdmitTokens(ctx context.Context, in decide.Input, input, output int64) Admission {
	w := &answerWriter{header: http.Header{}}
	pol := h.policy()
	var ferr *fieldError
	if in.Cost, ferr = tokensCost(nil, &input, &output, in.Model, pol.Cost, "estimated_tokens", "input_tokens", "max_output_tokens"); ferr == nil {
		ferr = firstBadID(idField{"tenant", in.Tenant, true}, idField{"user", in.User, true},
			idField{"endpoint", in.Endpoint, true}, idField{"model", in.Model, false})
	}
	if ferr != nil {
		return Admission{Status: http.StatusBadRequest, Message: ferr.Error()}
	}
	h.decide(ctx, w, routeLLM, in, http.StatusTooManyRequests, false)
	// The answer's body is small; decoding it keeps one writer of answers.
	var b struct {
		RequestID string `json:"request_id"`
		Reason    string `json:"reason"`
		Detail    string `json:"detail"`
		Message   string `json:"message"`
	}
	_ = json.Unmarshal(w.body, &b) // written by writeDecision or writeError: always valid
	a := Admission{Status: w.status, RequestID: b.RequestID, Header: w.header, Reason: b.Reason, Message: b.Message}
	if b.Detail != "" {
		a.Message = b.Detail
	}
	delete(a.Header, hdrContentType)
	delete(a.Header, hdrCacheControl)
	return a
}

// Release gives back a proxied request's reservation, as POST /v1/release
// does (its released event included): the upstream failed, or the client
// left, before any token.
func (h *Handler) Release(ctx context.Context, tenant, user, requestID string) error {
	_, err := h.release(ctx, tenant, user, requestID)
	return err
}

// ReportActual publishes the actual event of a proxied request as POST
// /v1/usage publishes a reported one (its id derived from the tenant, user
// and request id, so a repeat is stored once), waiting until the stream
// stored it. When the stream does not take it in time, the event goes to
// the outbox, which retries and spills it to disk: the proxy has no caller
// to retry for it. The error says it was not stored yet.
func (h *Handler) ReportActual(ctx context.Context, a events.Actual) error {
	evs, ferr := reportedEvents([]events.Event{events.NewActual(h.source, a, time.Now())}, []error{nil}, time.Now(), h.maxAge)
	if ferr != nil {
		return ferr
	}
	if err := evs[0].Validate(); err != nil {
		return err
	}
	if err := h.publishReported(ctx, evs); err != nil {
		h.ev.Enqueue(evs[0])
		return err
	}
	return nil
}
