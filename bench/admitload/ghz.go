package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	rlpb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	"quotaflow/bench/internal/load"
	"quotaflow/internal/envoypeer"
	"quotaflow/internal/gotool"
)

// The pinned ghz (github.com/bojand/ghz), the third -rls-client: a gRPC
// load tool of its own process, built on grpc-go, driven from a protoset
// and a JSON request template.
const (
	ghzPackage = "github.com/bojand/ghz/cmd/ghz"
	ghzVersion = "v0.93.0"
)

// ghz runs the pinned ghz binary against the RLS targets.
type ghz struct {
	bin, protoset string
}

// newGHZ builds ghz (once, into the user's cache) and writes the protoset
// of envoy's rls.proto into dir.
func newGHZ(dir string) (*ghz, error) {
	bin, err := gotool.Binary("ghz", ghzPackage, ghzVersion, "about 20 s")
	if err != nil {
		return nil, err
	}
	set := &descriptorpb.FileDescriptorSet{}
	seen := map[string]bool{}
	var add func(f protoreflect.FileDescriptor)
	add = func(f protoreflect.FileDescriptor) { // dependencies first
		if seen[f.Path()] {
			return
		}
		seen[f.Path()] = true
		for i := range f.Imports().Len() {
			add(f.Imports().Get(i).FileDescriptor)
		}
		set.File = append(set.File, protodesc.ToFileDescriptorProto(f))
	}
	add(rlpb.File_envoy_service_ratelimit_v3_rls_proto)
	b, err := proto.Marshal(set)
	if err != nil {
		return nil, err
	}
	g := &ghz{bin: bin, protoset: filepath.Join(dir, "rls.protoset")}
	return g, os.WriteFile(g.protoset, b, 0o644)
}

// ghzMaxDetails is the most calls ghz keeps a record of
// (runner.maxResult): its percentiles come from those.
const ghzMaxDetails = 1_000_000

// userMark stands for the user in the request template until it becomes
// ghz's template call.
const userMark = "USER-MARK"

// load calls ShouldRateLimit at addr for d from conc ghz workers over
// conns connections, each request of a random one of users with n
// descriptors. ghz reports percentiles, not each latency to this process:
// the result's histogram holds its 10th to 99th percentiles and its
// slowest call (as the last 1 %), weighted so that the same quantiles
// read back. Its answers are not read (each
// limit is far above a run's calls); its CPU (its whole process: start,
// a template rendered per call, its report of every call) is ChildCPU.
func (g *ghz) load(ctx context.Context, addr string, conns, conc, users, n int, d time.Duration) (*load.Result, error) {
	data, err := protojson.Marshal(envoypeer.BenchRequest(rlsDomain, userMark, n))
	if err != nil {
		return nil, err
	}
	tmpl := strings.ReplaceAll(string(data), userMark, "u{{randomInt 0 "+strconv.Itoa(users)+"}}")
	out, err := os.CreateTemp("", "ghz-*.json")
	if err != nil {
		return nil, err
	}
	defer os.Remove(out.Name())
	defer out.Close()
	cmd := exec.CommandContext(ctx, g.bin, "--insecure", "--protoset", g.protoset,
		"--call", "envoy.service.ratelimit.v3.RateLimitService.ShouldRateLimit",
		"-c", strconv.Itoa(conc), "--connections", strconv.Itoa(min(conns, conc)), "-z", d.String(), "--duration-stop", "ignore",
		"-m", `{"authorization":"Bearer `+rlsToken+`"}`, "-d", tmpl, "-O", "json", "-o", out.Name(), addr)
	if b, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("ghz: %v\n%s", err, b)
	}
	cpu := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	b, err := os.ReadFile(out.Name())
	if err != nil {
		return nil, err
	}
	// The report's last field lists every call: only what precedes it is
	// read.
	if i := bytes.Index(b, []byte(`,"details":`)); i >= 0 {
		b = append(b[:i], '}')
	}
	var rep struct {
		Count          uint64
		Total          time.Duration
		StatusCodeDist map[string]uint64 `json:"statusCodeDistribution"`
		ErrorDist      map[string]uint64 `json:"errorDistribution"`
		Latencies      []struct {
			Percentage int
			Latency    time.Duration
		} `json:"latencyDistribution"`
		Slowest time.Duration
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		return nil, fmt.Errorf("ghz's report: %w", err)
	}
	if rep.Count > ghzMaxDetails {
		return nil, fmt.Errorf("ghz: %d calls, more than the %d its percentiles are taken from: shorten -duration", rep.Count, ghzMaxDetails)
	}
	res := &load.Result{Requests: rep.StatusCodeDist["OK"], Elapsed: rep.Total, ChildCPU: cpu}
	res.Errors = rep.Count - res.Requests
	if res.Requests == 0 {
		return nil, fmt.Errorf("ghz: no answer: %v", rep.ErrorDist)
	}
	// Each percentile gets the calls between it and the one before, the
	// slowest the last 1 %.
	prev := 0
	for _, l := range append(rep.Latencies, struct {
		Percentage int
		Latency    time.Duration
	}{100, rep.Slowest}) {
		for range (l.Percentage - prev) * 100 {
			res.Latency.Record(l.Latency)
		}
		prev = l.Percentage
	}
	return res, nil
}
