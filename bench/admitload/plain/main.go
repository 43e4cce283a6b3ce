// Command plain is the baseline of the admission load benchmark: a plain
// net/http handler that answers every request with a fixed JSON body of the
// size admission's answers have, so the two are measured under one load.
package main

import (
	"flag"
	"log"
	"net/http"
	"strings"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "listen address")
	size := flag.Int("size", 900, "body size in bytes")
	flag.Parse()
	body := []byte(`{"allowed":true,"pad":"` + strings.Repeat("x", max(0, *size-25)) + `"}`)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/admit", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(body)
	})
	log.Fatal(http.ListenAndServe(*addr, mux))
}
