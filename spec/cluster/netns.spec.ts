/**
 * The network-namespace harness (spec/cluster/netns.ts) itself: without root or without `ip` it
 * throws saying why (a suite using it fails, it does not skip); a link set down cuts its host
 * off and set up heals it; {@link Net.close} and {@link cleanStale} leave no namespace, link or
 * process behind. Needs root and `ip netns` (as .ci/run has) for all but the first two.
 */
import { spawn } from 'node:child_process';
import { connect } from 'node:net';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { cleanStale, ip, Net, requireNetns, waitOutput } from './netns.js';

/** Whether a TCP connection to `host:port` is answered with `hi` within `ms`. */
function reach(host: string, port: number, ms: number): Promise<boolean> {
  return new Promise((resolve) => {
    const s = connect({ host, port });
    let got = '';
    const t = setTimeout(() => {
      s.destroy();
      resolve(false);
    }, ms);
    s.on('data', (d) => {
      got += d.toString();
    });
    s.on('error', () => {});
    s.on('close', () => {
      clearTimeout(t);
      resolve(got === 'hi');
    });
  });
}

const namespaces = (): string => ip('netns', 'list');
const links = (): string => ip('-j', 'link', 'show');

describe('requireNetns', () => {
  it('throws naming root when the process is not root', () => {
    const uid = vi.spyOn(process, 'getuid').mockReturnValue(1000);
    try {
      expect(() => requireNetns()).toThrow(/run them as root/);
    } finally {
      uid.mockRestore();
    }
  });

  it('throws naming iproute2 when `ip` cannot be run', () => {
    const path = process.env.PATH;
    process.env.PATH = '/nonexistent';
    try {
      expect(() => requireNetns()).toThrow(/`ip netns add` does not work here \(iproute2 needed/);
    } finally {
      process.env.PATH = path;
    }
  });
});

describe('Net (root and ip netns)', () => {
  let net: Net | undefined;
  afterAll(async () => {
    await net?.close();
  });

  it('a host reached over its link is cut off by down() and reached again after up(); close() removes everything', async () => {
    requireNetns();
    net = new Net();
    const h = net.host('a');
    const server = net.spawn(h, process.execPath, [
      '-e',
      `require('node:net').createServer((s) => s.end('hi')).listen(7000, '${h.address}', () => console.log('up'))`,
    ]);
    await waitOutput(server, /up/, 10_000, 'tcp server');
    expect(await reach(h.address, 7000, 3000)).toBe(true);
    net.down(h);
    expect(await reach(h.address, 7000, 1500)).toBe(false);
    net.up(h);
    expect(await reach(h.address, 7000, 5000)).toBe(true);
    expect(namespaces()).toContain(h.ns);
    const id = net.id;
    await net.close();
    net = undefined;
    expect(server.exitCode !== null || server.signalCode !== null).toBe(true);
    expect(namespaces()).not.toContain(id);
    expect(links()).not.toContain(id);
  });

  it('cleanStale() removes the namespaces and links of a test process that died', async () => {
    requireNetns();
    const dead = spawn(process.execPath, ['-e', '']);
    const pid = dead.pid!;
    await new Promise((r) => dead.once('exit', r));
    const ns = `vx41-${pid}-stale`;
    ip('netns', 'add', ns);
    ip('link', 'add', `v41s${pid % 100000}`, 'type', 'bridge');
    ip('link', 'set', `v41s${pid % 100000}`, 'alias', `vx41-${pid}-stale`);
    cleanStale();
    expect(namespaces()).not.toContain(ns);
    expect(links()).not.toContain(`vx41-${pid}-stale`);
  });
});
