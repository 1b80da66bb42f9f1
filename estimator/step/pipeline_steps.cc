#include "estimator/step/pipeline_steps.h"

#include <algorithm>
#include <vector>

namespace memledger {
namespace {

PipelineStep Forward(int64_t chunk) {
  PipelineStep s;
  s.kind = PipelineStep::Kind::kForward;
  s.chunk = chunk;
  return s;
}

PipelineStep Backward(int64_t chunk) {
  PipelineStep s;
  s.kind = PipelineStep::Kind::kBackward;
  s.chunk = chunk;
  return s;
}

PipelineStep Communicate() {
  PipelineStep s;
  s.kind = PipelineStep::Kind::kCommunicate;
  return s;
}

// OneFOneB: forward_backward_pipelining_without_interleaving: recv_forward, forward,
// send_forward for each warm-up micro-batch; recv_forward; then forward,
// send_forward_recv_backward, backward, send_backward_recv_forward (the last one only
// sends); then recv_backward, backward, send_backward for each cool-down micro-batch.
std::vector<PipelineStep> OneFOneB(const ParallelSpec& p, int64_t stage) {
  const bool first = stage == 0, last = stage == p.pp - 1;
  const int64_t m = p.micro_batches;
  const int64_t warmup = std::min(p.pp - stage - 1, m), remaining = m - warmup;
  std::vector<PipelineStep> steps;
  auto receive_input = [&]() {
    PipelineStep s = Communicate();
    s.receive_input = first ? -1 : 0;
    return s;
  };
  for (int64_t i = 0; i < warmup; ++i) {
    steps.push_back(receive_input());
    steps.push_back(Forward(0));
    PipelineStep send = Communicate();
    send.send_output = !last;
    steps.push_back(send);
  }
  if (remaining > 0) steps.push_back(receive_input());
  for (int64_t i = 0; i < remaining; ++i) {
    steps.push_back(Forward(0));
    PipelineStep forward_p2p = Communicate();
    forward_p2p.send_output = !last;
    forward_p2p.receive_output_grad = last ? -1 : 0;
    steps.push_back(forward_p2p);
    steps.push_back(Backward(0));
    PipelineStep backward_p2p = Communicate();
    backward_p2p.send_input_grad = !first;
    backward_p2p.receive_input = i + 1 < remaining && !first ? 0 : -1;
    steps.push_back(backward_p2p);
  }
  for (int64_t i = 0; i < warmup; ++i) {
    PipelineStep receive = Communicate();
    receive.receive_output_grad = 0;  // a warm-up stage is never the last
    steps.push_back(receive);
    steps.push_back(Backward(0));
    PipelineStep send = Communicate();
    send.send_input_grad = !first;
    steps.push_back(send);
  }
  return steps;
}

// Interleaved: forward_backward_pipelining_with_interleaving (overlap_p2p_comm off).
// Forward k runs local chunk (k mod pp v) / pp, backward k chunk v - 1 - that; the
// first rank's chunk 0 receives no input and sends no input gradient, the last rank's
// chunk v - 1 sends no output and receives no output gradient (it has the loss).
std::vector<PipelineStep> Interleaved(const ParallelSpec& p, int64_t stage) {
  const int64_t pp = p.pp, v = p.virtual_stages, m = p.micro_batches;
  const bool first = stage == 0, last = stage == pp - 1;
  const int64_t total = m * v;
  const bool all_warmup = m == pp;
  const int64_t warmup =
      all_warmup ? total : std::min((pp - stage - 1) * 2 + (v - 1) * pp, total);
  const int64_t remaining = total - warmup;
  // Python's modulo (Megatron's get_model_chunk_id): the last rank asks for the chunk
  // of backward k - (pp - 1), which is negative in the first iterations.
  auto chunk_of = [&](int64_t k, bool forward) {
    const int64_t group = pp * v;
    const int64_t c = (((k % group) + group) % group) / pp;
    return forward ? c : v - 1 - c;
  };
  // Whether a forward's output is sent: all but the model's last chunk's.
  auto sends_output = [&](int64_t chunk) { return !(last && chunk == v - 1); };
  // Whether a backward's input gradient is sent: all but the model's first chunk's.
  auto sends_input_grad = [&](int64_t chunk) { return !(first && chunk == 0); };
  std::vector<PipelineStep> steps;
  PipelineStep start = Communicate();  // recv_forward for chunk 0
  start.receive_input = first ? -1 : 0;
  steps.push_back(start);
  for (int64_t k = 0; k < warmup; ++k) {
    const int64_t chunk = chunk_of(k, true);
    steps.push_back(Forward(chunk));
    const int64_t next = chunk_of(k + 1, true);
    bool receive_previous = !(first && next == 0) && k != total - 1;
    PipelineStep p2p = Communicate();
    p2p.send_output = sends_output(chunk);
    p2p.receive_input = receive_previous ? next : -1;
    if (k == warmup - 1 && !all_warmup && !last) p2p.receive_output_grad = v - 1;
    steps.push_back(p2p);
  }
  for (int64_t k = 0; k < remaining; ++k) {
    const int64_t forward_k = k + warmup;
    const int64_t forward_chunk = chunk_of(forward_k, true);
    const int64_t backward_chunk = chunk_of(k, false);
    steps.push_back(Forward(forward_chunk));
    steps.push_back(Backward(backward_chunk));
    PipelineStep p2p = Communicate();
    p2p.send_output = sends_output(forward_chunk);
    p2p.send_input_grad = sends_input_grad(backward_chunk);
    bool receive_previous = true;
    int64_t next_forward = 0;
    if (first) {
      // The first rank is ahead of the last by pp - 1 forwards.
      const int64_t behind = chunk_of(forward_k - (pp - 1), true);
      receive_previous = behind != v - 1;
      next_forward = behind + 1;
    } else {
      next_forward = chunk_of(forward_k + 1, true);
    }
    bool receive_next = true;
    int64_t next_backward = 0;
    if (last) {
      const int64_t behind = chunk_of(k - (pp - 1), false);
      receive_next = behind != 0;
      next_backward = behind - 1;
    } else {
      next_backward = chunk_of(k + 1, false);
    }
    if (k == remaining - 1) receive_previous = false;
    p2p.receive_input = receive_previous ? next_forward : -1;
    p2p.receive_output_grad = receive_next ? next_backward : -1;
    steps.push_back(p2p);
  }
  if (all_warmup && !last) {
    PipelineStep receive = Communicate();  // recv_backward
    receive.receive_output_grad = v - 1;
    steps.push_back(receive);
  }
  for (int64_t k = remaining; k < total; ++k) {
    const int64_t chunk = chunk_of(k, false);
    steps.push_back(Backward(chunk));
    const int64_t next = chunk_of(k + 1, false);
    const bool receive_next = !(last && next == v - 1) && k != total - 1;
    PipelineStep p2p = Communicate();
    p2p.send_input_grad = sends_input_grad(chunk);
    p2p.receive_output_grad = receive_next ? next : -1;
    steps.push_back(p2p);
  }
  return steps;
}

}  // namespace

std::vector<PipelineStep> PipelineSteps(const ParallelSpec& p, int64_t stage) {
  return p.schedule == PipelineSchedule::kInterleaved ? Interleaved(p, stage) : OneFOneB(p, stage);
}

}  // namespace memledger
