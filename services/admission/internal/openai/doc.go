// Package openai is the codec of admission's LLM gateway mode for the
// OpenAI-compatible endpoints (/v1/chat/completions, /v1/completions,
// /v1/embeddings, /v1/responses): it reads, estimates and rewrites a
// request, and reads the usage of its response, streamed or not. It is
// pure: no network, no Redis, no clock.
//
// Before the call, Inspect validates a request body, counts its input
// tokens with the model's BPE encoding (github.com/pkoukk/tiktoken-go with
// the vocabularies compiled in from github.com/pkoukk/tiktoken-go-loader,
// loaded once on first use; Warm loads them at start), bounds its output
// (prompts × choices × maximum), and returns the body to send upstream:
// the client's bytes with a maximum set when it set none (so the actual can
// never exceed the estimate) and, for a stream, stream_options.include_usage
// set (so the upstream reports its usage).
//
// After the call, UsageOf reads the usage of a JSON response, and a Meter
// reads a server-sent-event stream as it passes: it forwards every byte at
// once, removes the usage chunk the client did not ask for, finds the
// usage, and counts the streamed text for when the usage never comes (the
// upstream fails midway, the client leaves).
//
// How tokens are counted: text with the model's encoding (o200k_base for
// gpt-4o, gpt-4.1, gpt-4.5, gpt-5, gpt-oss and the o-series; cl100k_base
// for gpt-4, gpt-3.5-turbo and the embedding models), and for a model
// with none ⌈bytes / Options.BytesPerToken⌉ (DefaultBytesPerToken). A chat
// message costs 3 tokens beyond its text and a name 1 more, and each reply
// 3, as in OpenAI's cookbook (the package counts its example as the API
// does: 124 tokens on gpt-4o, 129 on gpt-4); responses items count as chat
// messages; an image or audio part counts MediaTokens; a file part, and
// each context an upstream keeps (previous_response_id, conversation),
// Options.ReferenceTokens, since the body holds none of their text; tool
// definitions count as their JSON text. A request's first 64 KiB of text
// are tokenized, the rest extrapolated at their ratio but never below the
// fallback's (the caller chooses what comes first). A conversation sends its history
// again each turn, so the counts of long texts are remembered (a fixed-size
// cache per encoding). The actual usage corrects every estimate.
//
// All functions are safe for concurrent use; a Meter belongs to one stream.
package openai
