package main

import (
	"strings"
	"testing"

	"github.com/kelseyhightower/envconfig"

	"quotaflow/services/alerter/internal/deliver"
	"quotaflow/services/alerter/internal/detect"
)

func TestConfigDefaults(t *testing.T) {
	cfg := defaults()
	if err := envconfig.Process("QF_ALERTER_TEST_UNSET", &cfg); err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	if cfg.OpsAddr != ":9092" || cfg.Pprof || cfg.SpikeRate != 0.05 || cfg.SpikeMinRequests != 100 || cfg.AbuseBurst != 50 || cfg.TopTenants != 10 ||
		cfg.HeapFloorBytes != 64<<20 {
		t.Errorf("defaults = %+v", cfg)
	}
	cfg.SpikeRate = 2
	cfg.DeliveryMinBackoff = cfg.DeliveryMaxBackoff * 2
	cfg.TopTenants = 101
	cfg.AlertsAddr = cfg.OpsAddr
	cfg.OutboxRetention = cfg.DeliveryMaxAge
	err := cfg.Validate()
	if err == nil || !strings.Contains(err.Error(), "QF_SPIKE_RATE") || !strings.Contains(err.Error(), "QF_DELIVERY_MIN_BACKOFF") ||
		!strings.Contains(err.Error(), "QF_TOP_TENANTS 101: want 1 to 100") || !strings.Contains(err.Error(), "QF_ALERTS_ADDR: must differ from QF_OPS_ADDR") ||
		!strings.Contains(err.Error(), "QF_OUTBOX_RETENTION 24h0m0s: want longer than QF_DELIVERY_MAX_AGE") {
		t.Errorf("Validate = %v, want every mistake named", err)
	}
}

// QF_ALERT_HYSTERESIS 0 was accepted, and detect then used its default
// of 5 points: a value the alerter does not honour is refused.
func TestConfigHysteresis(t *testing.T) {
	for _, c := range []struct {
		v  float64
		ok bool
	}{{0, false}, {-1, false}, {80, false}, {0.5, true}, {79.5, true}} {
		cfg := defaults()
		if err := envconfig.Process("QF_ALERTER_TEST_UNSET", &cfg); err != nil {
			t.Fatal(err)
		}
		cfg.Hysteresis = c.v
		err := cfg.Validate()
		if c.ok && err != nil {
			t.Errorf("QF_ALERT_HYSTERESIS %v: %v", c.v, err)
		}
		if !c.ok && (err == nil || !strings.Contains(err.Error(), "QF_ALERT_HYSTERESIS")) {
			t.Errorf("QF_ALERT_HYSTERESIS %v: Validate = %v, want it named", c.v, err)
		}
	}
}

func TestExampleWebhooksFile(t *testing.T) {
	hooks, err := deliver.Load("../../deploy/webhooks.example.yaml", detect.Kinds)
	if err != nil || len(hooks) != 1 {
		t.Fatalf("Load(example) = %v, %v", hooks, err)
	}
}
