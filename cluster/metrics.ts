/**
 * The cluster's metrics (docs/operations.md "Metrics"): jobs sent to other nodes and served for them, the hop's cost,
 * failovers, late replies and whether NATS is reachable. Registered once per node; remote.ts and serve.ts count into them.
 */
import { Counter, Gauge, Histogram, type Registry } from 'prom-client';

/** The cluster's metrics (docs/operations.md "Metrics"). */
export interface ClusterMetrics {
  sent: Counter<'model' | 'node' | 'outcome'>;
  served: Counter<'model' | 'outcome'>;
  hop: Histogram<'model'>;
  nats: Gauge;
  late: Counter;
  failovers: Counter<'model' | 'why'>;
}

/** Registers the cluster's metrics in `reg`. */
export function clusterMetrics(reg: Registry): ClusterMetrics {
  return {
    sent: new Counter({
      name: 'voxserve_remote_jobs_sent_total',
      help: 'Jobs this ingress sent to other nodes, by model, holder and outcome',
      labelNames: ['model', 'node', 'outcome'],
      registers: [reg],
    }),
    served: new Counter({
      name: 'voxserve_remote_jobs_served_total',
      help: 'Jobs other nodes sent here, by model and outcome',
      labelNames: ['model', 'outcome'],
      registers: [reg],
    }),
    hop: new Histogram({
      name: 'voxserve_remote_hop_seconds',
      help: 'A remote job round trip less its run time at the holder',
      labelNames: ['model'],
      buckets: [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1],
      registers: [reg],
    }),
    nats: new Gauge({ name: 'voxserve_nats_connected', help: '1 while NATS is reachable', registers: [reg] }),
    late: new Counter({
      name: 'voxserve_remote_late_replies_total',
      help: 'Replies to job attempts this ingress had already given up (holder taken for gone, or NATS lost): dropped',
      registers: [reg],
    }),
    failovers: new Counter({
      name: 'voxserve_remote_failovers_total',
      help: 'Job attempts sent again because their holder was taken for gone (why: no_responders, deadline, heartbeats) or NATS was lost (lost)',
      labelNames: ['model', 'why'],
      registers: [reg],
    }),
  };
}
