import { randomUUID } from 'node:crypto';
import type { KV } from '@nats-io/kv';
import { voxError, type VoxError } from '../runtime/errors.js';
import { type Membership, type NodeRecord, until } from './membership.js';
import { nodeKey } from './nats.js';

/**
 * A node's name in the registry (`node.<name>` in the nodes bucket): claimed at join, then held by every heartbeat as
 * a compare-and-set on the revision of the node's own last write, so two processes never serve one name (every job
 * sent to it would run twice). One per {@link ClusterNode}.
 */
export class NodeName {
  /** Names this process's NATS sessions ({@link NodeRecord.session}: `<boot>.<reconnects>`). */
  readonly boot = randomUUID().slice(0, 8);
  /** Revision of this node's last write (0: none yet, or the bucket was made anew). */
  private rev = 0;
  private writing: Promise<unknown> = Promise.resolve();
  /** Another process took the name: nothing may be written or served under it any more. */
  lost = false;

  /**
   * @param bucket the nodes bucket now (it is replaced when NATS lost it and it was made anew).
   * @param membership whose registry view shows another process's heartbeats.
   */
  constructor(
    readonly name: string,
    private readonly bucket: () => KV,
    private readonly membership: Membership,
  ) {}

  private mine(r?: NodeRecord): boolean {
    return r?.session?.startsWith(`${this.boot}.`) === true;
  }

  /**
   * At join: an entry under this name written by another process and written again within 2.5 of its heartbeats is
   * another live process with the same name. An entry that is not written again is a dead process's (a restart after
   * a crash, or a process paused past its heartbeats) and is taken over.
   * @throws VoxError `node_name_taken` naming the other process's URL.
   */
  async claim(): Promise<void> {
    // The bucket itself: the registry watch may not have delivered it yet.
    const e = await this.bucket()
      .get(nodeKey(this.name))
      .catch(() => null);
    if (!e || e.operation !== 'PUT') return;
    const first = e.json<NodeRecord>();
    if (this.mine(first)) return;
    const again = (): boolean => {
      const now = this.membership.getSnapshot().context.view.get(this.name)?.record;
      return !!now && now.at !== first.at && !this.mine(now);
    };
    if (await until(this.membership, again, 2.5 * first.heartbeat_ms))
      throw voxError('node_name_taken', { node: this.name, url: first.url ?? 'its URL unknown' });
  }

  /**
   * Writes a heartbeat: the first a plain put (after {@link claim}), each later one a compare-and-set on this node's
   * last revision.
   * @returns null when written; else the error, and `taken` (the VoxError `node_name_taken` naming the other
   *   process's URL) when another process's entry stands under the name now: our own at another revision (a write
   *   whose answer was lost) is adopted, none (a bucket made anew) is written afresh next time.
   */
  write(value: Uint8Array): Promise<null | { error: Error; taken?: VoxError }> {
    // One at a time, in order: two at once would fail each other's compare-and-set.
    const written = this.writing.then(() => this.writeNow(value));
    this.writing = written.catch(() => null);
    return written;
  }

  private async writeNow(value: Uint8Array): Promise<null | { error: Error; taken?: VoxError }> {
    const key = nodeKey(this.name);
    try {
      this.rev = this.rev ? await this.bucket().update(key, value, this.rev) : await this.bucket().put(key, value);
      return null;
    } catch (error) {
      const e = await this.bucket()
        .get(key)
        .catch(() => undefined);
      if (e === undefined) return { error: error as Error }; // NATS did not answer: the next heartbeat tries again
      if (!e || e.operation !== 'PUT') this.rev = 0;
      else if (this.mine(e.json<NodeRecord>())) this.rev = e.revision;
      else {
        const url = e.json<NodeRecord>().url ?? 'its URL unknown';
        return { error: error as Error, taken: voxError('node_name_taken', { node: this.name, url }) };
      }
      return { error: error as Error };
    }
  }
}
