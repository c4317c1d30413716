/**
 * Test harness (issue 41, "Real links"): each nats-server and each voxserve node in its own network
 * namespace, joined by a veth pair to one bridge in the root namespace (where the test process
 * is, at `<subnet>.1`), each host at its own address on a private /24 (`10.41.N.0/24`, N free on
 * this machine). Faults: a host's link down (partition: its veth end on the bridge set down, so
 * it reaches neither NATS, nor the other nodes, nor the test) and up (heal); a process killed and
 * started again; a process paused (SIGSTOP) and resumed (SIGCONT).
 *
 * Needs root and `ip netns` (iproute2): {@link requireNetns} throws saying which is missing, so a
 * suite without them fails instead of skipping. Every namespace, link and process carries the
 * prefix `vx41-<pid>` (links: the alias), and {@link Net.close} removes them even after a failed
 * test; {@link cleanStale} removes those of a test process that died without closing.
 */
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const PREFIX = 'vx41';

/** Runs `ip ...args`; @throws Error with ip's stderr when it fails. */
export function ip(...args: string[]): string {
  return execFileSync('ip', args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
}

/**
 * Checks that this process may make network namespaces. @throws Error saying why not (not root,
 * no `ip` command, or `ip netns add` refused), for the suite to fail with.
 */
export function requireNetns(): void {
  if (process.getuid?.() !== 0)
    throw new Error('the netns suites make network namespaces: run them as root (as .ci/run does)');
  const probe = `${PREFIX}-probe-${process.pid}`;
  try {
    ip('netns', 'add', probe);
    ip('netns', 'del', probe);
  } catch (e) {
    throw new Error(`\`ip netns add\` does not work here (iproute2 needed, CAP_SYS_ADMIN): ${(e as Error).message}`);
  }
}

const alive = (pid: number): boolean => existsSync(`/proc/${pid}`);

/**
 * Removes the namespaces and links (bridges, veth ends) of earlier test processes that died
 * without cleaning up: those named or aliased `vx41-<pid>-...` whose pid is gone.
 */
export function cleanStale(): void {
  for (const line of ip('netns', 'list').split('\n')) {
    const m = new RegExp(`^(${PREFIX}-(\\d+)-\\S+)`).exec(line);
    if (m && !alive(Number(m[2]))) killInNamespaceAndDelete(m[1]);
  }
  const links = JSON.parse(ip('-j', 'link', 'show')) as { ifname: string; ifalias?: string }[];
  for (const l of links) {
    const m = new RegExp(`^${PREFIX}-(\\d+)`).exec(l.ifalias ?? '');
    if (m && !alive(Number(m[1]))) {
      try {
        ip('link', 'del', l.ifname);
      } catch {
        // gone with its pair
      }
    }
  }
}

function killInNamespaceAndDelete(ns: string): void {
  try {
    for (const pid of ip('netns', 'pids', ns).split('\n').filter(Boolean)) process.kill(Number(pid), 'SIGKILL');
  } catch {
    // none left
  }
  try {
    ip('netns', 'del', ns);
  } catch {
    // already gone
  }
}

/** One namespace on the bridge. */
export interface Host {
  /** Short name given to {@link Net.host} (`nats1`, `a`). */
  name: string;
  /** The namespace's name (`vx41-<pid>-<name>`). */
  ns: string;
  /** Its address on the bridge's subnet. */
  address: string;
  /** The veth end on the bridge (root namespace): set down for a partition. */
  link: string;
  /** Whether its link is up. */
  up: boolean;
}

/** A network of namespaces on one bridge; {@link Net.close} removes all of it. */
export class Net {
  readonly id = `${PREFIX}-${process.pid}`;
  readonly bridge: string;
  /** The bridge's address, the test process's own on this network. */
  readonly gateway: string;
  private readonly subnet: string;
  private readonly hosts: Host[] = [];
  private readonly procs = new Set<ChildProcess>();
  /** A temp folder for the processes' files (stores, configs), removed by {@link close}. */
  readonly dir = mkdtempSync(join(tmpdir(), `${PREFIX}-`));

  /** Makes the bridge on a free 10.41.N.0/24. @throws Error when ip refuses (see {@link requireNetns}). */
  constructor() {
    const short = String(process.pid % 100000);
    this.bridge = `v41b${short}`;
    const routes = ip('route', 'show');
    let n = process.pid % 250;
    while (routes.includes(`10.41.${n}.0/24`)) n = (n + 1) % 250;
    this.subnet = `10.41.${n}`;
    this.gateway = `${this.subnet}.1`;
    ip('link', 'add', this.bridge, 'type', 'bridge');
    ip('link', 'set', this.bridge, 'alias', `${this.id}-bridge`);
    ip('addr', 'add', `${this.gateway}/24`, 'dev', this.bridge);
    ip('link', 'set', this.bridge, 'up');
  }

  /** A new namespace `name` with loopback up and a veth link to the bridge at the next address. */
  host(name: string): Host {
    const i = this.hosts.length + 10;
    const ns = `${this.id}-${name}`;
    const link = `v41h${process.pid % 100000}-${this.hosts.length}`.slice(0, 15);
    const inner = `v41n${process.pid % 100000}-${this.hosts.length}`.slice(0, 15);
    ip('netns', 'add', ns);
    ip('-n', ns, 'link', 'set', 'lo', 'up');
    ip('link', 'add', link, 'type', 'veth', 'peer', 'name', inner);
    ip('link', 'set', link, 'alias', `${this.id}-${name}`);
    ip('link', 'set', inner, 'netns', ns);
    ip('-n', ns, 'link', 'set', inner, 'name', 'eth0');
    ip('-n', ns, 'addr', 'add', `${this.subnet}.${i}/24`, 'dev', 'eth0');
    ip('-n', ns, 'link', 'set', 'eth0', 'up');
    ip('link', 'set', link, 'master', this.bridge);
    ip('link', 'set', link, 'up');
    const h: Host = { name, ns, address: `${this.subnet}.${i}`, link, up: true };
    this.hosts.push(h);
    return h;
  }

  /** Partition: `h`'s link set down; it reaches nobody and nobody reaches it. */
  down(h: Host): void {
    ip('link', 'set', h.link, 'down');
    h.up = false;
  }

  /** Heal: `h`'s link set up again. */
  up(h: Host): void {
    ip('link', 'set', h.link, 'up');
    h.up = true;
  }

  /** Starts `command args` in `h`'s namespace (`ip netns exec`: the child is the command itself). */
  spawn(h: Host, command: string, args: string[]): ChildProcess {
    const child = spawn('ip', ['netns', 'exec', h.ns, command, ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
    this.procs.add(child);
    child.once('exit', () => this.procs.delete(child));
    return child;
  }

  /** Kills every process started here, the namespaces (with any process left in them), the links and the folder. */
  async close(): Promise<void> {
    const exits = [...this.procs].map(
      (c) => new Promise<void>((r) => (c.exitCode !== null ? r() : c.once('exit', () => r()))),
    );
    for (const c of this.procs) {
      c.kill('SIGCONT');
      c.kill('SIGKILL');
    }
    await Promise.race([Promise.all(exits), new Promise((r) => setTimeout(r, 5000))]);
    for (const h of this.hosts) killInNamespaceAndDelete(h.ns);
    try {
      ip('link', 'del', this.bridge);
    } catch {
      // not made
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** Stops `child` (SIGCONT first, in case it is paused; then `signal`, SIGKILL after 3 s) and waits for its exit. */
export async function stop(child: ChildProcess, signal: NodeJS.Signals = 'SIGTERM'): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise<void>((r) => child.once('exit', () => r()));
  child.kill('SIGCONT');
  child.kill(signal);
  const t = setTimeout(() => child.kill('SIGKILL'), 3000);
  await exited;
  clearTimeout(t);
}

/** Resolves when `child`'s stdout or stderr has printed a match of `re` (its match), rejects when it exits or after `ms`. */
export function waitOutput(child: ChildProcess, re: RegExp, ms: number, what: string): Promise<RegExpExecArray> {
  return new Promise((resolve, reject) => {
    let out = '';
    const on = (d: Buffer): void => {
      out += d.toString();
      const m = re.exec(out);
      if (m) {
        done();
        resolve(m);
      }
    };
    const onExit = (code: number | null): void => {
      done();
      reject(new Error(`${what} exited with ${code}: ${out.slice(-2000)}`));
    };
    const t = setTimeout(() => {
      done();
      reject(new Error(`${what} not ready in ${ms} ms: ${out.slice(-2000)}`));
    }, ms);
    const done = (): void => {
      clearTimeout(t);
      child.stdout?.off('data', on);
      child.stderr?.off('data', on);
      child.off('exit', onExit);
    };
    child.stdout?.on('data', on);
    child.stderr?.on('data', on);
    child.once('exit', onExit);
  });
}

/** One nats-server of a {@link natsCluster}: kill and restart keep its store (JetStream survives). */
export interface NatsHost {
  host: Host;
  /** `nats://address:4222`. */
  url: string;
  child: ChildProcess;
  /** Kills it (SIGKILL) and waits for its exit. */
  kill(): Promise<void>;
  /** Starts it again with the same name, routes and store; resolves when ready. */
  restart(): Promise<void>;
}

/**
 * `count` nats-servers, each in its own namespace, as one JetStream cluster (`-n nats<i>
 * --cluster_name vox --cluster nats://ADDR:6222 --routes` to all), client port 4222; resolves once
 * each says "Server is ready" (bounded: 20 s each).
 */
export async function natsCluster(net: Net, count: number): Promise<NatsHost[]> {
  const hosts = Array.from({ length: count }, (_, i) => net.host(`nats${i + 1}`));
  const routes = hosts.map((h) => `nats://${h.address}:6222`).join(',');
  const launch = async (h: Host, i: number): Promise<ChildProcess> => {
    const store = join(net.dir, h.name);
    const child = net.spawn(h, '/usr/sbin/nats-server', [
      '-js',
      '-sd',
      store,
      '-a',
      h.address,
      '-p',
      '4222',
      '-n',
      `nats${i + 1}`,
      '--cluster_name',
      'vox',
      '--cluster',
      `nats://${h.address}:6222`,
      '--routes',
      routes,
    ]);
    await waitOutput(child, /Server is ready/, 20_000, `nats-server ${h.name}`);
    return child;
  };
  return Promise.all(
    hosts.map(async (h, i) => {
      const s: NatsHost = {
        host: h,
        url: `nats://${h.address}:4222`,
        child: await launch(h, i),
        kill: () => stop(s.child, 'SIGKILL'),
        restart: async () => {
          await stop(s.child, 'SIGKILL');
          s.child = await launch(h, i);
        },
      };
      return s;
    }),
  );
}

/** A `voxserve serve --cluster` process in its own namespace. */
export interface VoxHost {
  host: Host;
  /** Node name in the cluster. */
  name: string;
  /** `http://address:8080`. */
  url: string;
  child: ChildProcess;
  /** Its log lines (pino JSON, `log_level` info), in order, with the wall time each was read. */
  log: { at: number; line: Record<string, unknown> }[];
}

/** The nodes' management token (`Authorization: Bearer ...`): a node on an address other than loopback needs one. */
export const MANAGEMENT_TOKEN = 'vx41-test';

const cli = new URL('../../dist/tools/cli.js', import.meta.url).pathname;

/**
 * Starts the compiled CLI (`npm run build` first) in `h`'s namespace as node `name` on `natsUrls`,
 * listening on `h.address:8080`, `log_level` info (kept in {@link VoxHost.log}); `config` is merged
 * into the config file (its `cluster` into the cluster's). Resolves once `/ready` answers 200
 * (bounded: 60 s). @throws Error with the process's output when it exits or is not ready in time.
 */
export async function voxNode(
  net: Net,
  h: Host,
  name: string,
  natsUrls: string[],
  config: Record<string, unknown> = {},
): Promise<VoxHost> {
  const file = join(net.dir, `${name}.json`);
  writeFileSync(
    file,
    JSON.stringify({
      host: h.address,
      port: 8080,
      log_level: 'info',
      management: { enabled: true, token: MANAGEMENT_TOKEN },
      ...config,
      cluster: { nats: natsUrls.join(','), node: name, ...(config.cluster as object | undefined) },
    }),
  );
  const child = net.spawn(h, process.execPath, [cli, 'serve', '--config', file]);
  const v: VoxHost = { host: h, name, url: `http://${h.address}:8080`, child, log: [] };
  let rest = '';
  child.stdout!.on('data', (d: Buffer) => {
    const lines = (rest + d.toString()).split('\n');
    rest = lines.pop()!;
    for (const l of lines) {
      if (!l.startsWith('{')) continue;
      v.log.push({ at: Date.now(), line: JSON.parse(l) });
      if (process.env.CLUSTER_LOG) process.stderr.write(`[${name}] ${l}\n`);
    }
  });
  child.stderr!.on('data', (d: Buffer) => process.env.CLUSTER_LOG && process.stderr.write(`[${name}] ${d}`));
  await waitOutput(child, /listening on (\S+)/, 60_000, `voxserve node ${name}`);
  const end = Date.now() + 60_000;
  for (;;) {
    const ok = await fetch(`${v.url}/ready`, { signal: AbortSignal.timeout(2000) })
      .then((r) => r.status === 200)
      .catch(() => false);
    if (ok) return v;
    if (Date.now() > end) throw new Error(`voxserve node ${name}: /ready not 200 in 60 s`);
    await new Promise((r) => setTimeout(r, 100));
  }
}
