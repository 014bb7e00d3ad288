// Order statistics of a handful of timings (steps, runs): the run summary's median step and
// trainer bench's spreads and percentiles.
#pragma once

#include <vector>

namespace weft {

// The median of `values` (the mean of the middle two for an even count); 0 for none.
double median_of(std::vector<double> values);
// The arithmetic mean of `values`; 0 for none.
double mean_of(const std::vector<double>& values);
// The p-th percentile (0 <= p <= 100) of `values`, interpolating linearly between the two closest
// ranks (numpy.percentile's default: rank p / 100 x (n - 1)); 0 for none.
double percentile_of(std::vector<double> values, double p);

}  // namespace weft
