package obs

// CodeClasses are the values of the `code` label of HTTP answers, for
// pre-creating a metric's series.
var CodeClasses = []string{"2xx", "4xx", "5xx"}

// CodeClass is an HTTP status's `code` label: "5xx", "4xx", else "2xx"
// (1xx and 3xx are not told apart: the services answer neither).
func CodeClass(code int) string {
	switch {
	case code >= 500:
		return "5xx"
	case code >= 400:
		return "4xx"
	}
	return "2xx"
}
