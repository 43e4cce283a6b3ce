package stream

// RefitAfter is refitAfter, for the tests of package stream_test.
const RefitAfter = refitAfter
