// Command plaingrpc is the baseline of the ShouldRateLimit benchmark: a
// grpc-go server with default settings whose ShouldRateLimit answers OK,
// one status per descriptor, without looking at a store: what the host
// and a load client allow a gRPC server that does no work, measured
// beside envoyproxy/ratelimit and admission under the same load.
package main

import (
	"context"
	"flag"
	"log"
	"net"

	rlpb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
)

type server struct {
	rlpb.UnimplementedRateLimitServiceServer
}

func (server) ShouldRateLimit(_ context.Context, req *rlpb.RateLimitRequest) (*rlpb.RateLimitResponse, error) {
	resp := &rlpb.RateLimitResponse{OverallCode: rlpb.RateLimitResponse_OK,
		Statuses: make([]*rlpb.RateLimitResponse_DescriptorStatus, len(req.Descriptors))}
	for i := range resp.Statuses {
		resp.Statuses[i] = &rlpb.RateLimitResponse_DescriptorStatus{Code: rlpb.RateLimitResponse_OK}
	}
	return resp, nil
}

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "listen address")
	flag.Parse()
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	g := grpc.NewServer()
	rlpb.RegisterRateLimitServiceServer(g, server{})
	log.Fatal(g.Serve(ln))
}
