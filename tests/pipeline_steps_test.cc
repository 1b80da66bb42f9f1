// PipelineSteps (estimator/step/pipeline_steps.h) against properties any correct schedule
// has, checked by replaying every rank's list together: each chunk runs every
// micro-batch forward then backward, in order; a forward's input and a backward's
// output gradient have been received before they are used; every message one rank
// sends is received, in the same order, by the rank that needs it; and the forwards
// and backwards come in Megatron-LM's order (hand-written below for small cases).
#include "estimator/step/pipeline_steps.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "estimator/request/parallel_spec.h"

namespace memledger {
namespace {

// A message: (global chunk, micro-batch), an activation entering the chunk or a
// gradient leaving it backwards.
using Message = std::pair<int64_t, int64_t>;

struct Replay {
  // Per global chunk: the activations entering it, as sent and as received; the
  // gradients leaving it backwards, as sent and as received.
  std::map<int64_t, std::vector<int64_t>> activations_sent, activations_received;
  std::map<int64_t, std::vector<int64_t>> grads_sent, grads_received;
  std::vector<std::string> problems;
  std::map<int64_t, std::string> order;  // per stage: "F0.0 B0.0 ..." (chunk.micro-batch)
};

Replay ReplayAll(const ParallelSpec& p) {
  Replay r;
  const int64_t v = p.virtual_stages;
  const int64_t last_chunk = p.pp * v - 1;
  for (int64_t stage = 0; stage < p.pp; ++stage) {
    auto global = [&](int64_t c) { return c * p.pp + stage; };
    std::vector<int64_t> forwards(v, 0), backwards(v, 0);
    std::vector<int64_t> inputs_ready(v, 0), grads_ready(v, 0);
    Message last_output{-1, -1}, last_input_grad{-1, -1};
    for (const PipelineStep& s : PipelineSteps(p, stage)) {
      if (s.kind == PipelineStep::Kind::kForward) {
        const int64_t j = forwards[s.chunk]++;
        const int64_t g = global(s.chunk);
        if (g != 0 && inputs_ready[s.chunk] <= j) {
          r.problems.push_back("forward without its input");
        }
        if (g != last_chunk) last_output = {g, j};
        r.order[stage] += "F" + std::to_string(s.chunk) + "." + std::to_string(j) + " ";
      } else if (s.kind == PipelineStep::Kind::kBackward) {
        const int64_t j = backwards[s.chunk]++;
        const int64_t g = global(s.chunk);
        if (j >= forwards[s.chunk]) r.problems.push_back("backward before its forward");
        if (g != last_chunk && grads_ready[s.chunk] <= j) {
          r.problems.push_back("backward without its output's gradient");
        }
        if (g != 0) last_input_grad = {g, j};
        r.order[stage] += "B" + std::to_string(s.chunk) + "." + std::to_string(j) + " ";
      } else {
        if (s.send_output) r.activations_sent[last_output.first + 1].push_back(last_output.second);
        if (s.send_input_grad) {
          r.grads_sent[last_input_grad.first].push_back(last_input_grad.second);
        }
        if (s.receive_input >= 0) {
          r.activations_received[global(s.receive_input)].push_back(inputs_ready[s.receive_input]++);
        }
        if (s.receive_output_grad >= 0) {
          // The gradient of this chunk's output leaves the next chunk.
          r.grads_received[global(s.receive_output_grad) + 1].push_back(
              grads_ready[s.receive_output_grad]++);
        }
      }
    }
    for (int64_t c = 0; c < v; ++c) {
      if (forwards[c] != p.micro_batches || backwards[c] != p.micro_batches) {
        r.problems.push_back("a chunk did not run every micro-batch");
      }
    }
  }
  return r;
}

TEST(PipelineStepsTest, EveryMessageIsReceivedInOrderAndBeforeItIsUsed) {
  struct Case {
    int64_t pp, v, m;
  };
  for (const Case& c : {Case{2, 1, 1}, Case{2, 1, 4}, Case{4, 1, 3}, Case{4, 1, 8}, Case{2, 2, 2},
                        Case{2, 2, 4}, Case{2, 3, 6}, Case{4, 2, 4}, Case{4, 2, 8},
                        Case{3, 2, 9}}) {
    ParallelSpec p;
    p.pp = c.pp;
    p.virtual_stages = c.v;
    p.micro_batches = c.m;
    p.schedule = c.v > 1 ? PipelineSchedule::kInterleaved : PipelineSchedule::k1F1B;
    SCOPED_TRACE(testing::Message() << "pp " << c.pp << " v " << c.v << " m " << c.m);
    const Replay r = ReplayAll(p);
    EXPECT_TRUE(r.problems.empty()) << r.problems.front();
    EXPECT_EQ(r.activations_sent, r.activations_received);
    EXPECT_EQ(r.grads_sent, r.grads_received);
    // Every chunk but the first receives each micro-batch's input once, in order.
    for (int64_t g = 1; g < c.pp * c.v; ++g) {
      std::vector<int64_t> in_order(c.m);
      for (int64_t j = 0; j < c.m; ++j) in_order[j] = j;
      EXPECT_EQ(r.activations_received.at(g), in_order) << g;
      EXPECT_EQ(r.grads_received.at(g), in_order) << g;
    }
  }
}

TEST(PipelineStepsTest, MegatronsOrderByHand) {
  // 1F1B, pp 2, 3 micro-batches: stage 0 warms up with one forward.
  ParallelSpec one_f_one_b;
  one_f_one_b.pp = 2;
  one_f_one_b.micro_batches = 3;
  Replay r = ReplayAll(one_f_one_b);
  EXPECT_EQ(r.order[0], "F0.0 F0.1 B0.0 F0.2 B0.1 B0.2 ");
  EXPECT_EQ(r.order[1], "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 ");
  // Interleaved, pp 2, 2 chunks per rank, 4 micro-batches: rank 0 warms up with
  // (2 - 0 - 1) x 2 + (2 - 1) x 2 = 4 forwards (chunk 0 of micro-batches 0, 1, then
  // chunk 1 of them), rank 1 with 2; forward k runs chunk (k mod 4) / 2, backward k the
  // other chunk first.
  ParallelSpec interleaved = one_f_one_b;
  interleaved.virtual_stages = 2;
  interleaved.micro_batches = 4;
  interleaved.schedule = PipelineSchedule::kInterleaved;
  r = ReplayAll(interleaved);
  EXPECT_EQ(r.order[0],
            "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3 ");
  EXPECT_EQ(r.order[1],
            "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3 ");
}

}  // namespace
}  // namespace memledger
