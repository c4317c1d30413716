// AudioWorklet processor of the /demo page: forwards the microphone's first channel to the page
// in blocks of `processorOptions.blockFrames` (at least 128) frames at the AudioContext's sample
// rate, as Float32Arrays whose buffers are transferred, not copied.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.frames = Math.max(128, (options.processorOptions && options.processorOptions.blockFrames) || 1024);
    this.block = new Float32Array(this.frames);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    let i = 0;
    while (i < channel.length) {
      const n = Math.min(channel.length - i, this.frames - this.filled);
      this.block.set(channel.subarray(i, i + n), this.filled);
      this.filled += n;
      i += n;
      if (this.filled === this.frames) {
        // Transferring detaches this.block: a new one takes its place.
        this.port.postMessage(this.block, [this.block.buffer]);
        this.block = new Float32Array(this.frames);
        this.filled = 0;
      }
    }
    return true;
  }
}

registerProcessor('voxserve-capture', CaptureProcessor);
