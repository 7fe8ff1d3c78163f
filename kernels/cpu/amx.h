/* AMX tile configuration, shared by the products (repack_amx.h, repack_amx_bf16.h) and the
 * prompt rows' attention (attention_amx.h). Tile instructions run only where the process
 * has asked Linux for the tile state (repack_amx.h's am_state; plait_repack_isa() is then
 * PLAIT_REPACK_AMX) and the thread has loaded a configuration. */
#ifndef PLAIT_CPU_AMX_H
#define PLAIT_CPU_AMX_H

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Loads the calling thread's tile configuration, palette 1: tile t of colsb[t] bytes x
 * rows[t] rows (0: unused). */
static inline void am_load_config(const int colsb[8], const int rows[8]) {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) {
    cfg.colsb[t] = (uint16_t)colsb[t];
    cfg.rows[t] = (uint8_t)rows[t];
  }
  _tile_loadconfig(&cfg);
}
#endif

#endif
