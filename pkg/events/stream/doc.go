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
// PublishBatch packs the events of each subject into batches (package
// events: a JSON array, Nats-Msg-Id events.BatchID) under the server's max
// payload (WithMaxPayload), compressed with S2 (HeaderContentEncoding,
// EncodingS2; WithCompression); a batch of one is a plain event.
// Consumers take batches compressed or not (Payload). Publishers in other
// languages may send single events only.
// A Batcher sits in front of it for services whose callers each wait for
// a few events to be stored (admission's POST /v1/usage): concurrent
// calls share one PublishBatch, a round closing at MaxEvents events or
// MaxWait after its first call (with FollowPublish, as long as the last
// rounds took to publish when that is less), and each caller gets its
// own events' result.
//
// # Consuming
//
// EnsureConsumer makes a durable pull consumer of every event from the
// first; Process handles one of its messages, a single event or a batch:
// it decodes its events (DecodeMsg), calls the handler for each valid one
// (Handlers.Dispatch routes by type), and ends the message once
// (Delivery.Finish): it acks, naks with a backoff, or dead-letters each
// event that is invalid or has failed MaxDeliver times alone
// (HeaderBatchIndex), so a bad event never stops a consumer nor holds up
// its neighbours. Consumers that handle many messages' events at once
// take them with Fetch (bounded in messages and bytes), decode each with
// DecodeMsg, handle them in Groups (which keeps a large fetch's later
// groups from being redelivered while they wait) and end each message
// with Delivery.Finish, or Reject when it is bad as a whole. Checks count
// events with EventIDs, never messages.
package stream
