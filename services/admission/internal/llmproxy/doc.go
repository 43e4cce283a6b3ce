// Package llmproxy is admission's LLM gateway mode (docs/design.md §10): an
// OpenAI-compatible reverse proxy that admits each request through the
// same decision as POST /v1/admit before it reaches the upstream, and
// reports what the upstream actually used as POST /v1/usage would.
//
// This file set holds its configuration: Settings (the QF_GATEWAY_*
// variables), the file (Build) and the Watcher that reloads it.
package llmproxy
