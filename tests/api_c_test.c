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
  /* A snapshot is a protocol-2 pickle (it opens with PROTO 2 and ends with STOP) of
   * binary length; one variant only. */
  char* snapshot = NULL;
  size_t size = 0;
  error = NULL;
  if (memledger_snapshot("{\"layers\": 2, \"variants\": \"full\"}", &snapshot, &size,
                         &error) != MEMLEDGER_OK ||
      snapshot == NULL || size < 3 || snapshot[0] != '\x80' || snapshot[1] != 2 ||
      snapshot[size - 1] != '.' || error != NULL) {
    fprintf(stderr, "FAIL: snapshot: %s\n", error != NULL ? error : "(no error)");
    ++failures;
  }
  memledger_free(snapshot);
  memledger_free(error);
  error = NULL;
  if (memledger_snapshot("{\"variants\": \"none,full\"}", NULL, &size, &error) !=
          MEMLEDGER_INVALID_ARGUMENT ||
      size != 0 || error == NULL || strstr(error, "one variant") == NULL) {
    fprintf(stderr, "FAIL: snapshot of two variants: %s\n", error != NULL ? error : "(none)");
    ++failures;
  }
  memledger_free(error);
  printf("api_c_test: %d passed, %d failed\n", 5 - failures, failures);
  return failures == 0 ? 0 : 1;
}
