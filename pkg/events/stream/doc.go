// Package stream carries quotaflow's events (package events) over NATS
// JetStream for Go services: the streams, a publisher, a durable consumer
// and the processing of its messages, dead letters and their replay. It
// uses only features of nats-server 2.9.
//
// # Streams
//
// Config names two streams and sets their limits; the default tags of its
// fields are the defaults, for envconfig and for a zero field alike. Ensure
// creates or updates both, and services call it before they report ready:
//
//   - the usage stream (Stream) keeps every event for MaxAge, on
//     events.UsageSubjects(SubjectPrefix), and drops a message whose
//     Nats-Msg-Id it stored within Duplicates;
//   - the dead-letter stream (DLQStream) keeps for DLQMaxAge, on
//     events.DLQSubject(SubjectPrefix, reason), what consumers could not
//     process: the original payload and headers (but Nats-*), and headers saying why
//     (HeaderError) and where it came from (HeaderSubject, HeaderStream,
//     HeaderSequence, HeaderMsgID, HeaderDelivered, HeaderFirstStored).
//     Replay publishes them again once the cause is fixed.
//
// # Publishing
//
// A Publisher validates each event, publishes it on its type's subject
// with Nats-Msg-Id set to the event's id, so a retry is stored once, and
// expects the usage stream to store it, so a misrouted prefix fails.
// A Batcher sits in front of it for services whose callers each wait for
// a few events to be stored (admission's POST /v1/usage): concurrent
// calls share one PublishBatch, a round closing at MaxEvents events or
// MaxWait after its first call, and each caller gets its own events'
// result.
//
// # Consuming
//
// EnsureConsumer makes a durable pull consumer of every event from the
// first; Process handles one of its messages: it decodes the event
// (DecodeMsg), calls the handler (Handlers.Dispatch routes by type), and
// acks, naks with a backoff, or dead-letters an event that is invalid or
// has failed MaxDeliver times, so a bad event never stops a consumer.
// Consumers that decode and handle a batch themselves end each message
// with Finish, or Reject.
package stream
