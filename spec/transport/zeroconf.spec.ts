/**
 * Issue 43 (f): voxserve's Wyoming service is announced by zeroconf (`_wyoming._tcp`, as
 * wyoming-openwakeword does), and python-zeroconf (the library Home Assistant uses; Debian's
 * `python3-zeroconf`) browsing for it finds it, with the listener's port, within 5 s. The server
 * and the browser run in a network namespace this test makes, with a veth pair inside it (multicast
 * on, 10.43.0.1/24 on one end): the host's own network is not touched, and a non-loopback address is what
 * turns the announcement on by default.
 */
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ServerConfig } from '../../runtime/config.js';
import { zeroconfWanted } from '../../transport/zeroconf.js';
import { until } from '../helpers.js';

const cli = fileURLToPath(new URL('../../dist/tools/cli.js', import.meta.url));
const NS = `vox43-${process.pid}`;
const ADDRESS = '10.43.0.1';
/** Debian's Python, where apt's python3-zeroconf is (not a pyenv or venv python3 earlier on the PATH). */
const PYTHON = '/usr/bin/python3';

/** Browses `_wyoming._tcp.local.` for up to 5 s in the namespace; one JSON line per service found. */
const BROWSE = `
import json, time
from zeroconf import ServiceBrowser, ServiceListener, Zeroconf
found = {}
class Listener(ServiceListener):
    def add_service(self, zc, type_, name):
        info = zc.get_service_info(type_, name, timeout=3000)
        if info:
            found[name] = {"name": name, "port": info.port, "addresses": info.parsed_addresses(), "server": info.server}
    def update_service(self, zc, type_, name):
        pass
    def remove_service(self, zc, type_, name):
        pass
zc = Zeroconf()
browser = ServiceBrowser(zc, "_wyoming._tcp.local.", Listener())
start = time.monotonic()
while time.monotonic() - start < 5 and not found:
    time.sleep(0.05)
for f in found.values():
    f["seconds"] = round(time.monotonic() - start, 2)
    print(json.dumps(f))
zc.close()
`;

const ip = (...args: string[]): string => execFileSync('ip', args, { encoding: 'utf8' });

beforeAll(() => {
  expect(process.getuid?.(), 'the zeroconf test makes a network namespace: run it as root (as .ci/run is)').toBe(0);
  try {
    execFileSync(PYTHON, ['-c', 'import zeroconf']);
  } catch {
    expect.fail('python-zeroconf is needed: apt-get install -y python3-zeroconf (bash .ci/run installs it)');
  }
  ip('netns', 'add', NS);
  ip('-n', NS, 'link', 'set', 'lo', 'up');
  // A veth pair, both ends inside: an interface that is not loopback, multicast on.
  ip('-n', NS, 'link', 'add', 'vx0', 'type', 'veth', 'peer', 'name', 'vx1');
  for (const dev of ['vx0', 'vx1']) {
    ip('-n', NS, 'link', 'set', dev, 'multicast', 'on');
    ip('-n', NS, 'link', 'set', dev, 'up');
  }
  ip('-n', NS, 'addr', 'add', `${ADDRESS}/24`, 'dev', 'vx0');
  ip('-n', NS, 'route', 'add', '224.0.0.0/4', 'dev', 'vx0');
});
afterAll(() => {
  try {
    ip('netns', 'del', NS);
  } catch {
    // not made
  }
});

/**
 * `voxserve serve` in the namespace with Wyoming on ADDRESS (a free port); resolves with its Wyoming port once
 * listening.
 */
async function serveInNamespace(extra: string[]): Promise<{ port: number; child: ChildProcess; stderr: () => string }> {
  const child = spawn(
    'ip',
    ['netns', 'exec', NS, process.execPath, cli, 'serve', '--port', '0', '--wyoming', `${ADDRESS}:0`, ...extra],
    {
      stdio: ['ignore', 'ignore', 'pipe'],
    },
  );
  let stderr = '';
  child.stderr!.on('data', (d) => (stderr += d));
  await until(() => /voxserve wyoming on tcp:\/\/[\d.]+:(\d+)/.test(stderr), 30_000);
  const port = Number(/voxserve wyoming on tcp:\/\/[\d.]+:(\d+)/.exec(stderr)![1]);
  // The zeroconf line follows the Wyoming one when there is one.
  await new Promise((r) => setTimeout(r, 200));
  return { port, child, stderr: () => stderr };
}

async function stop(child: ChildProcess): Promise<void> {
  const exited = new Promise((r) => child.once('exit', r));
  child.kill('SIGTERM');
  await exited;
}

/** What python-zeroconf finds in the namespace within 5 s. */
function browse(): { name: string; port: number; addresses: string[]; seconds: number }[] {
  const out = execFileSync('ip', ['netns', 'exec', NS, PYTHON, '-c', BROWSE], { encoding: 'utf8', timeout: 20_000 });
  return out
    .trim()
    .split('\n')
    .filter(Boolean)
    .map((l) => JSON.parse(l));
}

describe('zeroconf: _wyoming._tcp (issue 43)', () => {
  it('on by default when Wyoming listens beyond loopback: python-zeroconf finds it with its port within 5 s', async () => {
    const { port, child, stderr } = await serveInNamespace([]);
    try {
      expect(stderr()).toMatch(/voxserve zeroconf: _wyoming\._tcp as voxserve-/);
      const found = browse();
      expect(found.length, stderr()).toBe(1);
      expect(found[0].name).toMatch(/^voxserve-.*\._wyoming\._tcp\.local\.$/);
      expect(found[0].port).toBe(port);
      expect(found[0].addresses).toContain(ADDRESS);
      expect(found[0].seconds).toBeLessThan(5);
    } finally {
      await stop(child);
    }
  }, 60_000);

  it('--zeroconf NAME names it; --no-zeroconf announces nothing', async () => {
    const named = await serveInNamespace(['--zeroconf', 'kitchen']);
    try {
      expect(browse().map((f) => [f.name, f.port])).toEqual([['kitchen._wyoming._tcp.local.', named.port]]);
    } finally {
      await stop(named.child);
    }
    const off = await serveInNamespace(['--no-zeroconf']);
    try {
      expect(off.stderr()).not.toMatch(/zeroconf/);
      expect(browse()).toEqual([]);
    } finally {
      await stop(off.child);
    }
  }, 60_000);

  it('the default: on beyond loopback, off on loopback; wyoming.zeroconf decides when set', () => {
    const cfg = (wyoming: Record<string, unknown>) => ServerConfig.parse({ wyoming: { enabled: true, ...wyoming } });
    expect(zeroconfWanted(cfg({ host: '127.0.0.1' }))).toBe(false);
    expect(zeroconfWanted(cfg({ host: '0.0.0.0' }))).toBe(true);
    expect(zeroconfWanted(cfg({ host: '0.0.0.0', zeroconf: false }))).toBe(false);
    expect(zeroconfWanted(cfg({ host: '127.0.0.1', zeroconf: 'kitchen' }))).toBe(true);
  });
});
