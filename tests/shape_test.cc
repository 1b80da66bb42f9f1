// ATen's view rules as the walker applies them (strides in elements).
#include "estimator/graph/shape.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace memledger {
namespace {

Layout Strided(std::initializer_list<int64_t> sizes, std::initializer_list<int64_t> strides) {
  Layout layout;
  layout.ndim = static_cast<int>(sizes.size());
  int i = 0;
  for (int64_t s : sizes) layout.sizes[i++] = s;
  i = 0;
  for (int64_t s : strides) layout.strides[i++] = s;
  return layout;
}

TEST(ViewStridesTest, ContiguousFlattens) {
  // (2, 3, 4) contiguous has strides (12, 4, 1); viewed as (6, 4): strides (4, 1).
  bool overflow = false;
  Layout view;
  const int64_t sizes[] = {6, 4};
  ASSERT_TRUE(ViewStrides(Strided({2, 3, 4}, {12, 4, 1}), sizes, 2, &view, &overflow));
  EXPECT_EQ(view.strides[0], 4);
  EXPECT_EQ(view.strides[1], 1);
  EXPECT_FALSE(overflow);
}

TEST(ViewStridesTest, PermutedHeadsNeedACopy) {
  // q of a (B=2, T=3, 3*d=24) QKV output with H=2, d_head=4: (B, H, T, d_head) with
  // strides (T*3d = 72, d_head = 4, 3d = 24, 1). Merging B and H needs 72 == 4 * 2: no.
  bool overflow = false;
  Layout view;
  const int64_t sizes[] = {4, 3, 4};
  EXPECT_FALSE(ViewStrides(Strided({2, 2, 3, 4}, {72, 4, 24, 1}), sizes, 3, &view, &overflow));
}

TEST(ViewStridesTest, SizeOneDimensionsMergeFreely) {
  // The same q with H=1, d_head=4 (d=4, 3d=12): (2, 1, 3, 4), strides (36, 4, 12, 1).
  // A size-1 dimension never blocks a view: (2, 3, 4) with strides (36, 12, 1).
  bool overflow = false;
  Layout view;
  const int64_t sizes[] = {2, 3, 4};
  ASSERT_TRUE(ViewStrides(Strided({2, 1, 3, 4}, {36, 4, 12, 1}), sizes, 3, &view, &overflow));
  EXPECT_EQ(view.strides[0], 36);
  EXPECT_EQ(view.strides[1], 12);
  EXPECT_EQ(view.strides[2], 1);
}

// A row-major tensor views any sizes of its element count with their row-major strides;
// a tensor whose size-1 dimensions have other strides keeps some of them. The expected
// strides are what torch 2.15.0 prints: y = torch.empty(2, 3); x =
// torch.empty_strided((4, 1), (1, 7)); z = torch.empty_strided((1, 4), (99, 1)).
TEST(ViewStridesTest, RowMajorViewsAreRowMajorAndOthersKeepTheirSizeOneStrides) {
  auto view_strides = [](const Layout& old, std::vector<int64_t> sizes) {
    Layout view;
    bool overflow = false;
    const bool viewed =
        ViewStrides(old, sizes.data(), static_cast<int>(sizes.size()), &view, &overflow);
    EXPECT_FALSE(overflow);
    if (!viewed) return std::vector<int64_t>{};
    return std::vector<int64_t>(view.strides.begin(), view.strides.begin() + view.ndim);
  };
  const Layout y = Strided({2, 3}, {3, 1});
  EXPECT_EQ(view_strides(y, {3, 1, 2}), (std::vector<int64_t>{2, 2, 1}));
  EXPECT_EQ(view_strides(y, {1, 6, 1}), (std::vector<int64_t>{6, 1, 1}));
  EXPECT_EQ(view_strides(y, {7}), std::vector<int64_t>{});  // 6 elements are not 7
  EXPECT_EQ(view_strides(y, {5}), std::vector<int64_t>{});
  const Layout x = Strided({4, 1}, {1, 7});
  EXPECT_EQ(view_strides(x, {4, 1}), (std::vector<int64_t>{1, 7}));
  EXPECT_EQ(view_strides(x, {4}), (std::vector<int64_t>{1}));
  EXPECT_EQ(view_strides(x, {1, 4}), (std::vector<int64_t>{4, 1}));
  EXPECT_EQ(view_strides(x, {2, 2, 1}), (std::vector<int64_t>{2, 1, 7}));
  const Layout z = Strided({1, 4}, {99, 1});
  EXPECT_EQ(view_strides(z, {4, 1}), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(view_strides(z, {1, 1, 4}), (std::vector<int64_t>{4, 4, 1}));
}

// TensorIterator's output layouts; the expected strides are what torch 2.15.0 prints
// for the same tensors (x = torch.empty(2, 5, 3, 4).transpose(1, 2), cos =
// torch.empty(1, 5, 4).unsqueeze(1), c = torch.empty(2, 3, 5, 4)).
TEST(LayoutTest, ElementwiseOutputsFollowTheFirstDecidingInput) {
  const Layout x = Strided({2, 3, 5, 4}, {60, 4, 12, 1});
  const Layout cos = Strided({1, 1, 5, 4}, {20, 20, 4, 1});
  const Layout c = Strided({2, 3, 5, 4}, {60, 20, 4, 1});
  const int64_t sizes[] = {2, 3, 5, 4};
  bool overflow = false;
  auto strides = [](const Layout& l) {
    return std::vector<int64_t>(l.strides.begin(), l.strides.begin() + l.ndim);
  };
  // (x * cos).stride(): (60, 4, 12, 1), x's order; cos broadcasts over both orders.
  const Layout x_cos = Layout::Elementwise({&x, &cos}, sizes, 4, &overflow);
  EXPECT_EQ(strides(x_cos), (std::vector<int64_t>{60, 4, 12, 1}));
  // x * cos + c: (60, 4, 12, 1); c + x * cos: (60, 20, 4, 1).
  EXPECT_EQ(strides(Layout::Elementwise({&x_cos, &c}, sizes, 4, &overflow)),
            (std::vector<int64_t>{60, 4, 12, 1}));
  EXPECT_EQ(strides(Layout::Elementwise({&c, &x_cos}, sizes, 4, &overflow)),
            (std::vector<int64_t>{60, 20, 4, 1}));
  // torch.neg(x[..., :2]).stride(): (30, 2, 6, 1), dense in x's order.
  const Layout half = Strided({2, 3, 5, 2}, {60, 4, 12, 1});
  EXPECT_EQ(strides(Layout::Elementwise({&half}, half.sizes.data(), 4, &overflow)),
            (std::vector<int64_t>{30, 2, 6, 1}));
  // torch.neg(torch.empty(3, 1).expand(3, 4)).stride(): (4, 1).
  const Layout expanded = Strided({3, 4}, {1, 0});
  EXPECT_EQ(strides(Layout::Elementwise({&expanded}, expanded.sizes.data(), 2, &overflow)),
            (std::vector<int64_t>{4, 1}));
  EXPECT_FALSE(overflow);
}

TEST(LayoutTest, ContiguityIgnoresSizeOneDims) {
  EXPECT_TRUE(Strided({2, 1, 4}, {4, 99, 1}).IsContiguous());
  EXPECT_FALSE(Strided({2, 4}, {1, 2}).IsContiguous());
}

TEST(SymDimTest, EvaluatesMonomials) {
  ModelConfig config;  // B=16, T=64, d=128, H=4
  EXPECT_EQ((kB * kT).Evaluate(config).value(), 1024);
  EXPECT_EQ(kDHead.Evaluate(config).value(), 32);  // 128 / 4
  EXPECT_EQ((3 * kD).Evaluate(config).value(), 384);
}

}  // namespace
}  // namespace memledger
