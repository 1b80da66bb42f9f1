/* The C ABI from C: the header compiles as C and the calls link and work. */
#include <stdio.h>
#include <string.h>

#include "api/memledger.h"

int main(void) {
  char* response = NULL;
  char* error = NULL;
  int failures = 0;
  if (memledger_predict("{\"layers\": 2}", &response, &error) != MEMLEDGER_OK ||
      response == NULL || strstr(response, "\"saved_bytes\"") == NULL || error != NULL) {
    fprintf(stderr, "FAIL: predict: %s\n", error != NULL ? error : "(no error)");
    ++failures;
  }
  memledger_free(response);
  memledger_free(error);
  error = NULL;
  if (memledger_predict("{\"seq\": -1}", NULL, &error) != MEMLEDGER_INVALID_ARGUMENT ||
      error == NULL || strcmp(error, "--seq must be >= 1, got -1") != 0) {
    fprintf(stderr, "FAIL: bad seq: %s\n", error != NULL ? error : "(none)");
    ++failures;
  }
  memledger_free(error);
  response = NULL;
  error = NULL;
  if (memledger_plan("{\"layers\": 2, \"budget_gib\": 1}", &response, &error) != MEMLEDGER_OK ||
      response == NULL || strstr(response, "\"plan\"") == NULL || error != NULL) {
    fprintf(stderr, "FAIL: plan: %s\n", error != NULL ? error : "(no error)");
    ++failures;
  }
  memledger_free(response);
  memledger_free(error);
  printf("api_c_test: %d passed, %d failed\n", 3 - failures, failures);
  return failures == 0 ? 0 : 1;
}
