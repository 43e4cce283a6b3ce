// Package events is quotaflow's event contract: the CloudEvents every
// service publishes to and consumes from NATS JetStream, their subjects,
// ids, JSON and validation. It is plain Go, without NATS: Go services build
// and decode events with it and send them with package stream; services in
// other languages publish and read the JSON documented here.
//
// # Subjects
//
// Every event travels on "<prefix>.usage.<kind>" (Subject), so that one
// stream and one consumer filter, "<prefix>.usage.>" (UsageSubjects), cover
// them all. The prefix is the deployment's QF_SUBJECT_PREFIX ("quotaflow"
// unless configured), the stream its QF_STREAM (QUOTAFLOW_USAGE):
//
//	type                         subject                    published by
//	quotaflow.usage.reserved     <prefix>.usage.reserved    admission
//	quotaflow.usage.denied       <prefix>.usage.denied      admission
//	quotaflow.usage.actual       <prefix>.usage.actual      services
//	quotaflow.usage.released     <prefix>.usage.released    services, admission
//	quotaflow.usage.corrected    <prefix>.usage.corrected   accounter
//	quotaflow.balance.topup      <prefix>.usage.topup       admission
//
// An event consumers cannot process is kept, its payload unchanged, on
// "<prefix>.dlq.<reason>" (DLQSubject) in a second stream (QF_DLQ_STREAM,
// QUOTAFLOW_DLQ); package stream says which headers tell why.
//
// # Publishing and ids
//
// Publish each event as the structured JSON below with the NATS header
// Nats-Msg-Id set to its id (and Content-Type
// application/cloudevents+json). Ids are deterministic, so an event
// published again after a crash or timeout is dropped by the stream's
// duplicate window instead of counted twice:
//
//	reserved, actual, released, corrected:  H(type, tenant, user, request_id)
//	topup:                                  H("quotaflow.balance.topup", tenant, reference)
//	denied:                                 H("quotaflow.usage.denied", tenant, user, ip, endpoint,
//	                                          scope, name, decimal Unix second of time, origin)
//
// H(f1, f2, ...) is the SHA-256 of, for each field in order, its length in
// bytes as an 8-byte big-endian unsigned integer followed by its UTF-8
// bytes; the id is the lowercase hex of the first 16 bytes of the digest (32
// characters). An absent optional field (a denial's ip) is the empty
// string. For example H("quotaflow.usage.actual", "acme", "u-42", "r-123")
// is "a2b7081b1f6328815ae20e245fd52556". In Go: ID, TopUpID, DeniedID, or
// the builders NewReserved, NewActual and so on, which also set type,
// subject and time. Denials are aggregated per second: the event's time is
// the start of the second and count the denials in it. Several publishers
// may each count some denials of one key and second (admission scales
// out), so origin names the aggregate's publisher: any string unique to
// it and kept for as long as it may republish the aggregate. Admission
// uses a random id each process makes at start, and for a denial published
// on its own (more distinct keys in one second than it aggregates) that
// id, "/" and a sequence number. Consumers add the counts of every
// aggregate.
//
// # Batches (optional)
//
// A publisher may send many events in one message, which costs the server
// far less per event: a JSON array of events in the structured form below
// (CloudEvents JSON batch mode), with Content-Type
// application/cloudevents-batch+json (BatchContentType), 1 to 1024 events
// (MaxBatchEvents) and at most 1 MiB (MaxBatchSize), sent on the subject of
// its events' type. Its Nats-Msg-Id is "batch " and H of its event ids in
// order (BatchID), so the same batch published again is stored once; the
// space keeps it apart from every event id. An event published again in
// another batch may be stored twice: every quotaflow consumer counts an
// event id once. Consumers judge each event of a batch alone: one invalid
// event is dead-lettered by itself. Sending events one by one stays valid.
// In Go: EncodeBatch and DecodeBatch, or stream.Publisher.PublishBatch.
//
// # Envelope
//
// CloudEvents 1.0, structured JSON mode. Every attribute below is required
// except subject:
//
//   - specversion: "1.0"
//   - id: 1 to 256 printable ASCII characters without spaces; derive it as above
//   - source: the producer, e.g. "quotaflow/admission" (1 to 256 bytes)
//   - type: one of the six types above
//   - time: RFC 3339 (fractional seconds allowed) when it happened
//   - subject: "<tenant>/<user>" of data, informational only (tenant may
//     contain '/'); if present it must match data
//   - datacontenttype: "application/json"
//   - data: a JSON object, by type as below
//
// # Data
//
// Keys are snake_case and match exactly. Identifiers (request_id, tenant,
// user, plan, endpoint, model, limit names, reference) are UTF-8 of at most
// 256 bytes without control characters (U+0000–U+001F, U+007F–U+009F; the
// rule of package ident); required ones are non-empty. Counts are JSON
// integers (no fraction or exponent) from 0 to 1e12: required count fields
// must be written out even when 0. ip is an IPv4 or IPv6 address. Times are
// RFC 3339. Optional fields may be absent or null. Unknown keys are
// ignored, in the envelope (CloudEvents extensions) and in data.
//
// reserved: request_id, tenant, user, endpoint required; plan, model, ip
// optional; estimated_tokens (weighted tokens reserved) and version (the
// subject's version after this decision; 0 when admission decided without
// Redis, and then limits is the deciding instance's local view, not usage
// to alert on) required; expires_at required;
// tenant_version optional (the tenant's version, which orders snapshots of
// tenant-scope limits); limits (every limit that applied, after the
// decision) and would_deny (shadow limits that would have denied) optional
// arrays:
//
//	{
//	  "specversion": "1.0",
//	  "id": "0a8150dedb4bed65297fb56c7d57c2e7",
//	  "source": "quotaflow/admission",
//	  "type": "quotaflow.usage.reserved",
//	  "time": "2025-03-14T09:26:53Z",
//	  "subject": "acme/u-42",
//	  "datacontenttype": "application/json",
//	  "data": {
//	    "request_id": "r-123", "tenant": "acme", "user": "u-42", "plan": "pro",
//	    "endpoint": "/api/v1/generate", "model": "big-model", "ip": "203.0.113.7",
//	    "estimated_tokens": 1200, "expires_at": "2025-03-14T10:26:53Z",
//	    "version": 17, "tenant_version": 230,
//	    "limits": [
//	      {"scope": "user", "name": "5h", "unit": "tokens",
//	       "limit": 1000, "used": 990, "remaining": 10, "reset_seconds": 1800},
//	      {"scope": "global", "name": "daily", "endpoint": "/api/v1/generate", "unit": "requests",
//	       "limit": 500, "used": 42, "remaining": 458, "reset_seconds": 52387}
//	    ],
//	    "would_deny": [{"scope": "tenant", "name": "month"}]
//	  }
//	}
//
// A limits item is the admit response's: scope ("ip", "global", "tenant"
// or "user"), name, unit ("tokens" or "requests"), limit, used, remaining
// (negative only after a correction overshot), reset_seconds, all required,
// and endpoint for an endpoint's limits. A would_deny item has scope, name
// and optional endpoint. Drop a snapshot whose version is lower than the
// last one seen for the subject (tenant_version for tenant-scope limits).
//
// denied: tenant, user, endpoint, scope, name required, ip optional, count
// (at least 1) required; the denials of one second that one publisher
// counted (this one's origin: "6KBU4LCEX3JKN7GDQVHL2ZYAPM"):
//
//	{
//	  "specversion": "1.0",
//	  "id": "74ce1f8ced2293e2804f3d8c3e4df1bd",
//	  "source": "quotaflow/admission",
//	  "type": "quotaflow.usage.denied",
//	  "time": "2025-03-14T09:26:53Z",
//	  "subject": "acme/u-42",
//	  "datacontenttype": "application/json",
//	  "data": {"tenant": "acme", "user": "u-42", "ip": "203.0.113.7",
//	           "endpoint": "/api/v1/generate", "scope": "user", "name": "5h", "count": 3}
//	}
//
// actual: request_id, tenant, user required, endpoint and model optional,
// input_tokens and output_tokens required (raw tokens; the accounter
// applies the model's weights):
//
//	{
//	  "specversion": "1.0",
//	  "id": "a2b7081b1f6328815ae20e245fd52556",
//	  "source": "billing-proxy",
//	  "type": "quotaflow.usage.actual",
//	  "time": "2025-03-14T09:26:53Z",
//	  "subject": "acme/u-42",
//	  "datacontenttype": "application/json",
//	  "data": {"request_id": "r-123", "tenant": "acme", "user": "u-42",
//	           "endpoint": "/api/v1/generate", "model": "big-model",
//	           "input_tokens": 800, "output_tokens": 350}
//	}
//
// released: request_id, tenant, user, all required; the request failed
// before using tokens. From admission also status, what its release did in
// Redis ("released": the estimate given back, returned_tokens of it;
// "already_settled" or "unknown": nothing changed; "queued": Redis was
// unreachable and the consumer gives the estimate back); from other
// publishers status is absent and means queued. Actual usage always wins:
// an actual event of the request, before or after the release, is charged
// in full.
//
//	{
//	  "specversion": "1.0",
//	  "id": "49c9d0b54945199851c4125bc3ab59a0",
//	  "source": "quotaflow/admission",
//	  "type": "quotaflow.usage.released",
//	  "time": "2025-03-14T09:26:53Z",
//	  "subject": "acme/u-42",
//	  "datacontenttype": "application/json",
//	  "data": {"request_id": "r-124", "tenant": "acme", "user": "u-42",
//	           "status": "released", "returned_tokens": 1200}
//	}
//
// corrected: request_id, tenant, user, delta (actual - estimate in weighted
// tokens, -1e12 to 1e12) and version required; tenant_version and limits
// (the touched limits after the correction) optional:
//
//	{
//	  "specversion": "1.0",
//	  "id": "96f3e863b0e8ab136911abc8e753d984",
//	  "source": "quotaflow/accounter",
//	  "type": "quotaflow.usage.corrected",
//	  "time": "2025-03-14T09:26:53Z",
//	  "subject": "acme/u-42",
//	  "datacontenttype": "application/json",
//	  "data": {"request_id": "r-123", "tenant": "acme", "user": "u-42",
//	           "delta": 650, "version": 18, "tenant_version": 231,
//	           "limits": [{"scope": "user", "name": "5h", "unit": "tokens",
//	                       "limit": 1000, "used": 990, "remaining": 10, "reset_seconds": 1800}]}
//	}
//
// topup: tenant, amount (at least 1) and reference required, user optional
// (empty for a tenant-wide balance):
//
//	{
//	  "specversion": "1.0",
//	  "id": "80e380f3d4a4777071521e28ebc6dc6b",
//	  "source": "quotaflow/admission",
//	  "type": "quotaflow.balance.topup",
//	  "time": "2025-03-14T09:26:53Z",
//	  "subject": "acme/u-42",
//	  "datacontenttype": "application/json",
//	  "data": {"tenant": "acme", "user": "u-42", "amount": 50000, "reference": "pay_8Hq2"}
//	}
//
// # Validation
//
// Decode enforces all of the above, rejects events over 64 KiB, invalid
// UTF-8, duplicate keys and trailing data, and reports every problem by
// path ("invalid event: data.input_tokens: must be >= 0"). Consumers also
// refuse an event whose time lies further before its first storage than
// the stream keeps events, or more than MaxSkew after it (CheckTime). These
// errors wrap ErrInvalid: such an event can never succeed, so consumers
// dead-letter it (stream.Process does) rather than retry. stream.Publisher
// validates before sending, so what Go services publish always decodes.
// A consumer that reads no limit snapshot decodes with
// Decoder.NoSnapshots, which neither reads nor checks one: the accounter
// does, leaving an event whose snapshot alone is wrong to the alerter.
package events
